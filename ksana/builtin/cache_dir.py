"""Where built-in models live on disk (``ksana.kernels.build_cache``), and ``transformers``' progress while building."""

from __future__ import annotations

import contextlib
import functools

from ksana.kernels.build_cache import CACHE_DIR_ENV, build_cached, ksana_cache_dir

__all__ = ["CACHE_DIR_ENV", "build_cached", "ksana_cache_dir", "transformers_progress"]


@contextlib.contextmanager
def transformers_progress(enabled: bool):
    """Show or hide ``transformers``' progress bars while building, restoring the previous setting after."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)  # the dequantisation bar ignores the setting above
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()
