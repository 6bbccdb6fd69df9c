"""Session-wide test setup.

Triton's interpreter (TRITON_INTERPRET=1) must be chosen before triton is first imported, by any
module: transformers and torch can import it on their own. Without a CUDA device it is the only
way Triton kernels run, so the whole session uses it (tests/kernels/test_triton_attention.py,
tests/test_gpu_check.py); with one, kernels run compiled on the device.

Also here: the pack cache's folder (a temporary one per session), and the fixtures many files share (the embedded model's tokenizer, a grammar backend, the
embedded model itself), built once per session. The markers (pyproject.toml) sort the tests into
tiers: `slow`, `server` (a real `onecall serve` subprocess) and `browser` (Chromium);
`make test-fast` runs the rest.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from onecall import LLM
    from onecall.sampling.grammar import GrammarBackend
    from onecall.text.tokenizer import Tokenizer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A GGUF's packed weights are cached on disk after a load (loading/pack_cache.py): in a folder of this
# session's own, never the user's ~/.cache; subprocess servers inherit it; removed at exit.
_PACK_CACHE = tempfile.mkdtemp(prefix="onecall-pack-cache-")
os.environ.setdefault("ONECALL_PACK_CACHE_DIR", _PACK_CACHE)
atexit.register(shutil.rmtree, _PACK_CACHE, ignore_errors=True)


def _silence_stderr() -> None:
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def pytest_unconfigure(config: object) -> None:
    """Triton's interpreter can leave IR objects alive until interpreter shutdown, where nanobind
    reports them ("nanobind: leaked N instances") on stderr, after pytest's summary line. The summary
    is the run's last word: once pytest is done (atexit runs after it restored its captured file
    descriptors, before the shutdown report), stderr is closed, only when triton was loaded."""
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)


# ---- shared fixtures: built once per session, used read-only --------------------------------------
@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Tiny matmuls: one thread is faster, and immune to OpenMP stalls on a busy 2-core box. A module
    opts in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# Tests that need another configuration (another dtype, KV budget, thread count) build their own.
@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The embedded SmolLM2-135M-Instruct's tokenizer: the object the tiny engines use too."""
    from tests.helpers.tiny_engine import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session")
def grammar_backend(tok: Tokenizer) -> GrammarBackend:
    """A GrammarBackend on that tokenizer (its llguidance tokenizer takes ~0.6 s to build). Sharing it
    shares its cache of compiled grammars, which only changes a constraint's `trace.cache_hit`: the
    tests of the cache build backends of their own."""
    from onecall.sampling.grammar import GrammarBackend

    return GrammarBackend(tok)


@pytest.fixture(scope="session")
def _embedded_llm() -> LLM:
    from onecall import LLM

    return LLM()  # the embedded SmolLM2-135M-Instruct (Q4_1 GGUF), float32 on CPU


@pytest.fixture(scope="module")
def llm(_embedded_llm: LLM) -> LLM:
    """The embedded model with the default configuration, loaded once per session. Each module starts it
    with no request in flight and an empty prefix cache, as a freshly loaded one (a cache hit runs a
    prompt's last token through the one-query kernel, whose bits can differ from a prefill's: README,
    "Batch invariance")."""
    assert not _embedded_llm.engine.has_unfinished_requests(), "a module left requests in flight"
    _embedded_llm.reset_prefix_cache()
    return _embedded_llm
