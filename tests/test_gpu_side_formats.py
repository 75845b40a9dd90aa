"""GPU-side faults without an Xid number, and CUDA errors in the spellings frameworks print, are each one
finding with the right class and hardware/application call in every transport a real node writes them in:
dmesg (plain, -T, -H relative), syslog and journald with the kernel: prefix, /dev/kmsg records, and CRI
container lines (whole and split into partial records).

Every message is quoted from a public thread (URL next to it, development half of the corpus); the
transport prefixes around it are the ones each tool writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.analyze_helpers import analyze_cli

# Kernel messages: (message, rule, fault class, recommended action). Each asks for the GPU to be reset.
KERNEL = {
    # https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1230 (GSP stopped answering)
    "gsp heartbeat": ("NVRM: GPU6 _kgspIsHeartbeatTimedOut: Heartbeat timed out, currentTimeMs 812751949 "
                      "heartbeat 1899482 heartbeatWithOffsetMs 812745879 diff 6070 timeout 5200",
                      "nvrm-gsp-timeout", "gpu_hardware", "reset_gpu"),
    # https://github.com/NVIDIA/nvtrust/issues/77 (the GPU never came up)
    "rminitadapter": ("NVRM: GPU 0000:01:00.0: RmInitAdapter failed! (0x62:0x1a:1792)",
                      "nvrm-rminitadapter-failed", "gpu_lost", "reset_gpu"),
    # https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1045 (driver calls demand a reset)
    "reset required": ("NVRM: GPU0 nvCheckOkFailedNoLog: Check failed: Reset required [NV_ERR_RESET_REQUIRED] "
                       "(0x00000062) returned from _gpushareddataSendDataPollRpc(pGpu, polle>",
                       "nvrm-reset-required", "gpu_hardware", "reset_gpu"),
}

KERNEL_FORMATS = {
    "dmesg": "[ 1843.308145] {m}\n",
    "dmesg -T": "[Thu Oct 23 10:03:12 2025] {m}\n",
    "dmesg -H relative": "[  +0.000844] {m}\n",
    "syslog RFC 3164": "Oct 23 10:03:12 gpu-node-7 kernel: {m}\n",
    "syslog RFC 5424": "<4>1 2025-10-23T10:03:12.000Z gpu-node-7 kernel - - - {m}\n",
    "journalctl -o short-iso": "2025-10-23T10:03:12+0000 gpu-node-7 kernel: {m}\n",
    "/dev/kmsg": "3,1234,1843308145,-;{m}\n",
}

# Lines a training container prints: (message, rule, fault class, hardware call).
CONTAINER = {
    # https://github.com/ollama/ollama/issues/12136 (NVSwitch fabric not initialised: fabric manager)
    "fabric not initialised": ("ggml_cuda_init: failed to initialize CUDA: system not yet initialized",
                               "cuda-system-not-initialized", "nvlink", False),
    # https://github.com/QwenLM/Qwen3/issues/873 (cuBLAS could not allocate: the GPU is full)
    "cublas alloc": ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                     "cublas-alloc-failed", "oom_gpu", False),
    # https://github.com/PaddlePaddle/Paddle/issues/57411 (Paddle's spelling of a launch failure)
    "paddle launch failure": ("OSError: (External) CUDA error(719), unspecified launch failure.",
                              "cuda-unspecified-launch-failure", "app_error", None),
    # https://github.com/NovaSearch-Team/RAG-Retrieval/issues/27 (a rank asked for a GPU the node lacks)
    "invalid ordinal": ("[rank5]: RuntimeError: CUDA error: invalid device ordinal",
                        "cuda-invalid-device-ordinal", "app_error", False),
    # https://github.com/sxyu/svox2/issues/6 (a kernel's launch needs more than the GPU gives a block)
    "launch resources": ("RuntimeError: CUDA error: too many resources requested for launch",
                         "cuda-launch-out-of-resources", "app_error", False),
}


def cri(message: str, split: bool) -> str:
    stamp = "2025-10-23T10:03:12.000000000Z stdout"
    if not split:
        return f"{stamp} F {message}\n"
    cut = len(message) // 2
    return f"{stamp} P {message[:cut]}\n{stamp} F {message[cut:]}\n"



@pytest.mark.parametrize("fmt", list(KERNEL_FORMATS))
@pytest.mark.parametrize("case", list(KERNEL))
def test_a_gpu_fault_without_an_xid_is_one_finding_in_every_kernel_log_format(
    case: str, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    message, rule, fault_class, action = KERNEL[case]
    [incident] = analyze_cli(tmp_path, capsys, KERNEL_FORMATS[fmt].format(m=message))
    [finding] = incident["findings"]
    assert (finding["rule_id"], incident["fault_class"], incident["recommended_action"]) == (rule, fault_class, action)
    assert finding["message"].startswith("NVRM: "), "the transport prefix is stripped before the rule sees it"


@pytest.mark.parametrize("split", [False, True], ids=["CRI full record", "CRI partial records"])
@pytest.mark.parametrize("case", list(CONTAINER))
def test_a_cuda_error_spelling_is_one_finding_with_its_call_in_container_logs(
    case: str, split: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    message, rule, fault_class, hardware = CONTAINER[case]
    [incident] = analyze_cli(tmp_path, capsys, cri(message, split))
    assert [f["rule_id"] for f in incident["findings"]] == [rule]
    assert incident["fault_class"] == fault_class
    if hardware is not None:
        assert incident["hardware"] is hardware
    # None of these is a reason to take the node out of service on one occurrence.
    assert incident["recommended_action"] not in ("replace_node", "reboot_node")


def test_a_display_watchdog_listing_is_not_a_launch_timeout(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # https://github.com/numba/numba/issues/9381: the device listing that explains the timeout is no fault.
    listing = ("Found 1 CUDA devices\n"
               "id 0         b'Quadro T1000'                              [SUPPORTED]\n"
               "                                    Watchdog: Enabled\n")
    assert analyze_cli(tmp_path, capsys, listing) == []
    # https://github.com/numba/numba/issues/4351: the timeout itself is the application's kernel.
    [incident] = analyze_cli(tmp_path, capsys, cri(
        "numba.cuda.cudadrv.driver.CudaAPIError: [702] Call to cuMemcpyDtoH results in CUDA_ERROR_LAUNCH_TIMEOUT",
        split=False))
    assert (incident["fault_class"], incident["recommended_action"]) == ("app_error", "fix_application")
