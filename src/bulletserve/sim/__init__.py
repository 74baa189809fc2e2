"""Discrete-event simulator: the `sched/` policies on a device modeled by `perf/`.

The simulator carries a policy's plans out on a virtual clock exactly as the engine's executors
do (`engine/engine.py` for one lane, `engine/lanes.py` for Bullet's two); only the clock and the
device differ. Step durations come from the performance model, with seeded noise.
"""
