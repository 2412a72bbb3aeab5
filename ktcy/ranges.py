"""A sorted list of numbers in the Linux kernel's CPU-list form: (0, 1, 2, 5) -> "0-2,5".  CPU
lists (NUMA placement, `ktcy doctor`) and a model's layer list share it; the checked reader of
that form is ktcy.distributed.numa.parse_cpulist."""


def ranges_text(numbers):
    """(0, 1, 2, 5) -> "0-2,5"; nothing -> ""."""
    runs = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
