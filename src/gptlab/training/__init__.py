"""The training stage: a model learns from a prepared data folder, into a run folder.

`train` (the loop, read top to bottom: batch -> forward -> backward -> clip -> step -> log -> eval -> checkpoint),
`step` (one optimizer step and one evaluation, also used by `gptlab bench train`), `preflight` (everything checked
before anything is written: data against model, memory, the run folder, what a resume must satisfy), `resume` (a
checkpoint's progress, model, optimizer and random state loaded back, the metrics log cut back to it), `faults`
(what training does when something goes wrong: signals, non-finite losses, loss spikes, running out of memory) and
`loggers` (`--log`: each row to TensorBoard, a CSV file, Weights & Biases or MLflow).
Only the run policy (runs.py) and the bench wing import it; import the modules themselves, this file
imports nothing.
"""
