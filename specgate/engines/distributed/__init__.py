"""One model over several ranks: the lock-step protocol that makes every
rank run the same step (lockstep.py) and the doorbell that wakes followers
(doorbell.py).

May import the rest of engines/ and kernels/. See docs/DESIGN.md, "A model
over several ranks".
"""
