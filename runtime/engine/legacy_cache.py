"""The seeds' legacy KV layout: one ``[max_seq_len]`` row per running request.

Seen from attention it is a paged cache with a single block of ``max_seq_len`` slots per request,
so the same slot-mapping / block-table code serves both layouts.
"""

from collections import deque

from runtime.errors import UserError
from runtime.layers.attention import LEGACY


class LegacyCacheRows:
    def __init__(self, num_rows: int, max_seq_len: int):
        self.block_size = max_seq_len
        self.group_keys = [LEGACY]
        self._free = deque(range(num_rows))
        self._rows: dict = {}
        self._num_rows, self._peak = num_rows, 0

    def allocate_slots(
        self, request_id, computed_tokens: int, num_new_tokens: int, lookahead_tokens: int = 0
    ) -> bool:
        if computed_tokens + num_new_tokens + lookahead_tokens > self.block_size:
            raise UserError(
                f"request {request_id} needs {computed_tokens + num_new_tokens} positions but the "
                f"legacy KV cache rows hold {self.block_size} (input_truncated_len + "
                "max_new_tokens); raise them in the YAML or use the paged KV path."
            )
        if request_id not in self._rows:
            if not self._free:
                return False
            self._rows[request_id] = self._free.popleft()
            self._peak = max(self._peak, len(self._rows))
        return True

    def free(self, request_id) -> None:
        self._free.append(self._rows.pop(request_id))

    def block_tables(self, request_ids) -> dict[str, list[list[int]]]:
        return {LEGACY: [[self._rows[r]] for r in request_ids]}

    def stats(self) -> dict:
        return {
            "layout": "legacy",
            "num_blocks": self._num_rows,
            "block_size": self.block_size,
            "used_blocks": len(self._rows),
            "peak_used_blocks": self._peak,
        }

    def usage_summary(self) -> str:
        return f"legacy kv cache: {len(self._rows)} rows in use, peak {self._peak} of {self._num_rows}"
