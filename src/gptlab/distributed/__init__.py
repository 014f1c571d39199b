"""Training in several processes: `processes` (joining torchrun's process group, the checks every process makes
at start-up, each rank's rows of the batch, DDP / FSDP wrapping, launching torchrun) and `fsdp` (FSDP2 from the
inside: a model built on the meta device and initialised shard by shard exactly as a whole build, slice-wise
checkpoint reads and writes). The sharded checkpoints' file I/O (gptlab.sharded) stays beside checkpoint.py, which
calls it: moving it here would make checkpoint.py import this package, which imports checkpoint.py. Only the
training stage, the run policy (runs.py) and the CLI import this package; import the modules themselves, this file
imports nothing.
"""
