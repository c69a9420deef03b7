"""How many KV cache blocks to allocate."""

from runtime.errors import UserError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_batch(batch_size: int, max_seq_len: int, block_size: int) -> int:
    """Blocks for `batch_size` sequences of `max_seq_len` tokens, plus the null block."""
    return batch_size * cdiv(max_seq_len, block_size) + 1


def blocks_for_memory(free_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Blocks that fit in `fraction` of `free_bytes`."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    n = int(free_bytes * fraction) // bytes_per_block
    if n < 2:
        raise UserError(
            f"only {n} KV cache block(s) fit in {fraction:.0%} of {free_bytes / 2**20:.1f} MiB free memory "
            f"({bytes_per_block} bytes per block); at least 2 are needed. "
            "Raise scheduler_config.mem_fraction_static, use a smaller block_size, set num_kv_blocks, or free "
            "device memory."
        )
    return n
