# SPDX-License-Identifier: Apache-2.0
"""Getting vision weights: Hub sources (``hub``), checkpoint identity and layout (``checkpoint``),
and the vision-only loader (``loader``)."""
