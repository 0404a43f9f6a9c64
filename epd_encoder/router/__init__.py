# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder route``: Envoy balances, a thin stateless splitter cuts requests per item (docs/router.md)."""
