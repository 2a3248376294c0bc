"""Checkpoints, one concern per module.

- ``folder``: the run folder's ``step-N`` folders as files: pick, verify, commit, keep K (no torch).
- ``lock``: one writer per run folder (no torch).
- ``parts``: what a checkpoint holds, part by part.
- ``store``: the bytes, through torch.distributed.checkpoint; the untrusted-input guard.
- ``checkpointer``: the one owner a run talks to.
"""
