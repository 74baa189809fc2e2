"""What the partitioners allow, torch-free, so the simulator models the same unit space as the
engine."""

from __future__ import annotations


def gpu_min_remainder(total_sms: int) -> int:
    """Fewest SMs a lane may run on as the remainder beside a carved green-context group. On an
    H200, cuBLAS GEMMs failed (CUBLAS_STATUS_EXECUTION_FAILED) on a prefill on the 12 and 20
    SMs left beside 120- and 112-SM groups, while prefills on remainders of 52 to 124 ran (and
    a decode on 36); 21-51 were not tried, so the floor is the smallest that ran a prefill,
    2/5 of the device. Carved groups of 8 SMs and more all ran."""
    return 2 * total_sms // 5
