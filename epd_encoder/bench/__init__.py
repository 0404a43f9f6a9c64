# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder bench``: a load generator for encode servers (docs/bench.md).

workload.py plans requests (sizes, Zipf duplicates, videos, traces); media.py renders
their bytes; load.py runs a closed or open loop; deliver.py times one request per
delivery mode; scrape.py reads /metrics deltas; server.py starts and stops servers;
report.py writes JSON, a PNG and a table; cli.py wires them.
"""
