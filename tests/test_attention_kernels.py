"""cuDNN's attention is off where batches change shape (SFT, preference training) on CUDA: it builds
an execution plan per new shape, which left an H200 idle for most of each SFT step (2026-11-27)."""

from __future__ import annotations

import pytest
import torch

from train.core.device import attention_kernels
from train.run.plan.build import PretrainingSource
from train.run.plan.dpo import DPOSource
from train.run.plan.sft import SFTSource


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_off_only_where_shapes_vary_on_cuda(cudnn_flag):
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert attention_kernels(torch.device("cpu"), True) is None and torch.backends.cuda.cudnn_sdp_enabled()
    # the process-wide switch follows each plan: SFT turns it off (and says why), pretraining on again
    why = attention_kernels(torch.device("cuda"), SFTSource.shapes_vary)
    assert "execution plan for each new shape" in why and not torch.backends.cuda.cudnn_sdp_enabled()
    # said again for a second plan
    assert attention_kernels(torch.device("cuda"), DPOSource.shapes_vary) == why
    assert attention_kernels(torch.device("cuda"), PretrainingSource.shapes_vary) is None
    assert torch.backends.cuda.cudnn_sdp_enabled()
