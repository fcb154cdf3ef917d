"""The data: datasets (MNIST and its kin, IDX files; checked, cached, downloaded) and images to predict on.
"""
