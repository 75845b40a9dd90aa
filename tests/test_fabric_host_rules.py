"""Fabric and host rules on real lines through the `kmend analyze` path: a skipped HCA at NCCL start-up
is no fault while a verbs failure on a device in use still is, and fabric manager / CUDA fabric, NCCL
topology, Gloo connect, kubelet container manager, container OOM kill and object-store upload failures name
their class and the hardware/application call."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.records import Action, FaultClass
from analyzer.rules import default_rules_dir, load_rules
from tests.analyze_helpers import analyze_bundle

RULES = load_rules([default_rules_dir()])

# A pod started without the host's RDMA device: NCCL skips the HCA and runs over sockets
# (https://github.com/NVIDIA/nccl/issues/451).
SOCKET_FALLBACK = """\
NCCL INFO NCCL_IB_DISABLE set by environment to 0.
misc/ibvwrap.cc:212 NCCL WARN Call to ibv_open_device failed
transport/net_ib.cc:148 NCCL WARN NET/IB : Unable to open device mlx5_bond_0
NCCL INFO NET/IB : No device found.
NCCL INFO NET/Socket : Using [0]bond0:200.1.93.2<0>
NCCL INFO Using network Socket
"""
# QP creation failing on the HCA NCCL uses (https://github.com/NVIDIA/nccl/issues/562).
CREATE_QP = "hai-a100-3:3778851:3779883 [4] ibvwrap.c:130 NCCL WARN Call to ibv_create_qp failed\n"



def test_an_hca_skipped_at_start_up_with_a_socket_fallback_opens_no_incident(tmp_path: Path) -> None:
    assert analyze_bundle(tmp_path, "container", SOCKET_FALLBACK, RULES) == []


def test_a_verbs_failure_on_the_device_in_use_is_still_a_network_fault(tmp_path: Path) -> None:
    incidents = analyze_bundle(tmp_path, "container", CREATE_QP, RULES)
    assert [i.fault_class for i in incidents] == [FaultClass.NETWORK]
    assert incidents[0].root_finding.rule_id == "ibv-call-failed"
    assert incidents[0].root_finding.fields["call"] == "ibv_create_qp"


@pytest.mark.parametrize(("source", "text", "rule", "fault_class", "action"), [
    # https://github.com/NVIDIA/gpu-operator/issues/544
    ("syslog", "nv-fabricmanager[3228]: fabric manager NVIDIA GPU driver interface version 530.30.02 don't match "
               "with driver version 530.41.03. Please update with matching NVIDIA driver package.\n",
     "fabric-manager-driver-mismatch", FaultClass.NVLINK, Action.NOTIFY),
    # https://github.com/dstackai/dstack/issues/2348
    ("container", "/opt/conda/envs/workflow/lib/python3.9/site-packages/torch/cuda/__init__.py:129: UserWarning: CUDA "
                  "initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
                  "calling NumCudaDevices() that might have already set an error? Error 802: system not yet "
                  "initialized (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)\n",
     "cuda-system-not-initialized", FaultClass.NVLINK, Action.NOTIFY),
    # https://github.com/NVIDIA-NeMo/Run/issues/266
    ("container", "graph/topo.h:230 NCCL WARN Could not find NET with id 0\n",
     "nccl-topology-net-missing", FaultClass.NCCL_ERROR, Action.FIX_APPLICATION),
    # https://github.com/facebookarchive/caffe2/issues/360
    ("container", "RuntimeError: [/nfs/AMBUJ/Caffe2_LatestGLOO2/caffe2/third_party/gloo/gloo/transport/tcp/"
                  "pair.cc:611] Connect timeout [172.17.27.13]:27023\n",
     "gloo-connect-timeout", FaultClass.NCCL_ERROR, Action.RESTART_JOB),
    # https://github.com/kubernetes/minikube/issues/11280
    ("syslog", "docker + crio: kubelet \"Failed to start ContainerManager failed to initialize top level QOS "
               "containers: root container [kubepods] doesn't exist\"\n",
     "kubelet-container-manager-failed", FaultClass.NODE, Action.NOTIFY),
    # https://github.com/gimlet-io/gimlet/issues/649 (kubectl describe pod)
    ("kubectl", "Last State:     Terminated\n  Reason:       OOMKilled\n  Exit Code:    137\n",
     "container-oom-killed", FaultClass.OOM_HOST, Action.FIX_APPLICATION),
    # https://github.com/gensyn-ai/rl-swarm/issues/463 (dmesg, the report cut before the victim line)
    ("kernel", "[597411.196310] p2pd invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, "
               "oom_score_adj=0\n",
     "oom-killer-invoked", FaultClass.OOM_HOST, Action.FIX_APPLICATION),
    # https://github.com/Azure/azure-storage-python/issues/245
    ("container", "I'm trying to upload a bunch of CSV to Azure Blob Storage using this library and I'm having the "
                  "following exception: `AzureException: ('Connection aborted.', timeout('The write operation timed "
                  "out',))`.\n",
     "object-store-write-timeout", FaultClass.STORAGE, Action.NOTIFY),
    # https://github.com/tensorflow/tensorflow/issues/6493
    ("container", "Unavailable: Unexpected response code 410\n         when resuming upload "
                  "gs://chatbot_generic/chatbot_generic_20161224_211637/translate.ckpt-1.data-00000-of-00001\n",
     "gcs-resumable-upload-gone", FaultClass.STORAGE, Action.NOTIFY),
])
def test_fabric_and_host_failures_name_class_and_call(tmp_path: Path, source: str, text: str, rule: str,
                                                      fault_class: FaultClass, action: Action) -> None:
    incidents = analyze_bundle(tmp_path, source, text, RULES)
    assert len(incidents) == 1, incidents
    top = incidents[0]
    assert (top.root_finding.rule_id, top.fault_class, top.recommended_action) == (rule, fault_class, action)
    # None of these is a failed part: no node is taken out for them.
    assert top.hardware is False


def test_pytorchs_newer_watchdog_wording_wrapped_by_a_terminal_is_a_collective_timeout(tmp_path: Path) -> None:
    # https://github.com/mila-iqia/milabench/pull/269
    text = ("dinov2-giant-nodes.cn-d003.nolog [stderr] [rank3]:[E909 09:55:46.996672294 ProcessGroupNCCL.cpp:1709] "
            "[PG 0 (default_pg) Rank 3] Timeout at NCCL work: 2070, last enqueued \n"
            "NCCL work: 2082, last completed NCCL work: 2069.\n")
    [incident] = analyze_bundle(tmp_path, "container", text, RULES)
    assert (incident.root_finding.rule_id, incident.fault_class) == ("nccl-work-timeout", FaultClass.NCCL_TIMEOUT)
    assert incident.root_finding.fields["seq"] == "2070"


def test_pytorchs_internal_error_spelling_is_ncclInternalError(tmp_path: Path) -> None:
    # https://github.com/NVIDIA-NeMo/Run/issues/266
    line = ("torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:3376, internal error - please report this issue to the NCCL developers, "
            "NCCL version 2.25.1\n")
    incidents = analyze_bundle(tmp_path, "container", line, RULES)
    assert [i.root_finding.rule_id for i in incidents] == ["nccl-internal-error"]
