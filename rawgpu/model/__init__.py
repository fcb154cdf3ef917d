"""The model: the recipe (every setting of a run and its rules), the MLP's plan and arena, the stack of many models,
the split fp32 master weights and the optimiser's state. Plain planning in Python over the kernels' launchers.
"""
