"""The in-process engines' prompt caches: one prefix cache per model in RAM
(prefix_cache.py) with its disk tier (prefix_disk.py).

May import engines/base.py, memory.py and kernels/. See docs/DESIGN.md,
"The prefix cache".
"""
