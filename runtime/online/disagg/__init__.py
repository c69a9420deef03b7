"""Prefill-decode disaggregation: prefill instances compute a prompt's KV and first token, decode instances
receive them (re-sharded by KV head when their TP sizes differ) and generate the rest."""
