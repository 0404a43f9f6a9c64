# SPDX-License-Identifier: Apache-2.0
"""The vision towers, one family per module (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, InternVL,
Kimi K2.5), on the shared Qwen blocks of ``qwen_vision``; ``models.registry`` maps a checkpoint to one."""
