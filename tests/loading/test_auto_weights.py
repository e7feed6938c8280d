"""`auto` weights: w4a8 on the CPU where the native kernels load, full elsewhere; resolved before a job is stored."""

from __future__ import annotations

import pytest
import torch

from spec_batch.cli.queue import _worker_queues
from spec_batch.loading.kernels.build import native_ops
from spec_batch.loading.load import requested_precision
from spec_batch.loading.weights import auto_weights, resolve_precision
from spec_batch.settings import get_settings

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(not native_ops("auto"), reason="no C++ compiler: the native kernels do not build")


@needs_native
def test_auto_is_w4a8_on_the_cpu_where_the_kernels_build() -> None:
    assert auto_weights(CPU, torch.float32) == "w4a8"
    assert auto_weights(CPU, torch.bfloat16) == "w4a8"
    assert resolve_precision("auto", None, CPU, torch.float32).label() == "w4a8/float32"
    assert requested_precision("auto", None) == ("w4a8", None)


def test_auto_is_full_without_the_kernels_on_cuda_and_in_float16(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auto_weights(torch.device("cuda"), torch.bfloat16) == "full"
    assert auto_weights(CPU, torch.float16) == "full"
    monkeypatch.setenv("SPEC_BATCH_COMPILE", "off")
    assert auto_weights(CPU, torch.float32) == "full"
    assert requested_precision("auto", "float32") == ("full", "float32")


def test_the_api_default_stays_full_and_the_settings_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPEC_BATCH_WEIGHTS", raising=False)
    assert get_settings().weights == "auto"
    assert resolve_precision(None, None, CPU, torch.float32).weights == "full"


@needs_native
def test_a_workers_queue_names_its_devices_resolution_never_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPEC_BATCH_DEFAULT_DRAFT", raising=False)
    monkeypatch.delenv("SPEC_BATCH_DEFAULT_TARGET", raising=False)
    cpu_queue = _worker_queues((), (), "auto", None, "cpu")
    assert cpu_queue == _worker_queues((), (), "w4a8", None, "cpu")
    assert "w4a8" in cpu_queue[0] and "auto" not in cpu_queue[0]
    # a CUDA worker's auto is full: the queue of full-weight jobs (no precision part)
    assert _worker_queues((), (), "auto", None, "cuda") == _worker_queues((), (), "full", None, "cpu")
