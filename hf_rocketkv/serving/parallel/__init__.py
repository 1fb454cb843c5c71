"""Tensor-parallel serving: every rank's engine steps in lockstep with rank 0's (``Lockstep``, the inboxes).
"""
