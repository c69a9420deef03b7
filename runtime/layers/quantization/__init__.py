"""Quantization methods of linear layers (the seed's ``quant_method``: ``base.py``) and the pass that applies
one at load (``online.py``)."""
