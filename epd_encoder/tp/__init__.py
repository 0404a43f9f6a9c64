# SPDX-License-Identifier: Apache-2.0
"""Tensor- and data-parallel encode over several ranks (``serve --tp N``).

``shard.py`` (with ``layers.py``): weights mode, a vision tower sharded by heads and MLP
columns, loaded shard by shard. The process group and the data mode live beside it.
"""
