"""Jobs of several processes and hosts: which rank a process is (launchers.py), how the ranks meet (rendezvous.py,
torchrun_store.py) and end (job.py), one host's forked ranks (processes.py), a sweep spread over ranks.
"""
