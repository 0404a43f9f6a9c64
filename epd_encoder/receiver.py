# SPDX-License-Identifier: Apache-2.0
"""The prefill side's entry point: ``from epd_encoder.receiver import EmbeddingReceiver``."""

from epd_encoder.transfer.receiver import EmbeddingReceiver, ReceivedItem

__all__ = ["EmbeddingReceiver", "ReceivedItem"]
