"""What every engine shares (the interface the manager drives, the engine thread, the waiting queue, per-request
sampling draws) and ``SequentialEngine``, one request at a time through ``generate()``.
"""
