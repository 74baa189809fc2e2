"""What the engine and the simulator share to carry out a policy's plans, torch-free: the step
record every step-log writer and reader uses (record.py), the request book (book.py) and the
two lanes' state machine (lanes.py). The engine adds threads, the device and tokens; the
simulator adds a virtual clock and the performance model's durations."""
