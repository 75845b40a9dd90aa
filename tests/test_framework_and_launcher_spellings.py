"""Real lines from older frameworks, launchers, Slurm and the kubelet through the `kmend analyze` path:
GPU out-of-memory as TensorFlow, Caffe, MXNet, Darknet and Paddle print it; XLA's, Gloo's and the AWS OFI
plugin's collective failures; NCCL's truncated messages; PyTorch's heartbeat monitor; Slurm's newer
OOM-kill wording and GPU GRES problems; a node without a working driver; NFS mount failures; kubelet
admission rejections of GPU pods; and torchrun start-up notices that are no fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.records import Action, FaultClass
from analyzer.rules import default_rules_dir, load_rules
from tests.analyze_helpers import analyze_bundle

RULES = load_rules([default_rules_dir()])


@pytest.mark.parametrize(("source", "text", "rule", "fault_class", "hardware", "action"), [
    # https://github.com/naturomics/CapsNet-Tensorflow/issues/39
    ("container", "InternalError (see above for traceback): Dst tensor is not initialized.\n",
     "tensorflow-dst-tensor-oom", FaultClass.OOM_GPU, False, Action.FIX_APPLICATION),
    # https://github.com/yahoo/CaffeOnSpark/issues/204
    ("container", "F1206 16:55:19.914152  3830 parallel.cpp:85] Check failed: error == cudaSuccess (2 vs. 0)  "
                  "out of memory\n*** Check failure stack trace: ***\n",
     "caffe-cuda-oom", FaultClass.OOM_GPU, False, Action.FIX_APPLICATION),
    # https://github.com/apache/mxnet/issues/675
    ("container", "`mxnet.base.MXNetError: [11:18:15] src/storage/./pooled_storage_manager.h:157: cudaMalloc failed: "
                  "out of memory\n",
     "mxnet-cudamalloc-oom", FaultClass.OOM_GPU, False, Action.FIX_APPLICATION),
    # https://github.com/pjreddie/darknet/issues/1796
    ("container", "   29 CUDA Error: out of memory\ndarknet: ./src/cuda.c:36: check_error: Assertion `0 'failed.\n",
     "cuda-error-out-of-memory", FaultClass.OOM_GPU, False, Action.FIX_APPLICATION),
    # https://github.com/PaddlePaddle/Paddle/issues/42228
    ("container", "Out of memory error on GPU 0. Cannot allocate 98.000244MB memory on GPU 0, 6.000000GB memory has "
                  "been allocated and available memory is only 0.000000B.\n",
     "paddle-gpu-oom", FaultClass.OOM_GPU, False, Action.FIX_APPLICATION),
    # https://github.com/j-towns/vdvae-jax/issues/2
    ("container", "RuntimeError: Internal: external/org_tensorflow/tensorflow/compiler/xla/service/gpu/"
                  "nccl_all_reduce_thunk.cc:162: NCCL operation ncclAllReduce(send_buffer, recv_buffer, "
                  "buffer.element_count, datatype, reduce_op, comm, *cu_stream) failed: invalid usage: while running "
                  "replica 0 and partition 0 of a replicated computation (other replicas may have failed as well).\n",
     "xla-nccl-misuse", FaultClass.NCCL_ERROR, False, Action.FIX_APPLICATION),
    # https://github.com/aws/aws-ofi-nccl/issues/1020
    ("container", "[2025-10-16 22:16:08] ip-172-31-3-90:1929:1937 [0] nccl_net_ofi_rdma_init:7978 NCCL WARN NET/OFI "
                  "OFI fi_getinfo() call failed: No data available\n",
     "nccl-ofi-setup-failed", FaultClass.NCCL_ERROR, False, Action.FIX_APPLICATION),
    # https://github.com/NVIDIA/nccl/issues/1176
    ("container", "0: compute-st-p4de24xlarge-1:34639:36718 [5] bootstrap.cc:77 NCCL WARN Message truncated : "
                  "received 256 bytes instead of 4\n",
     "nccl-message-truncated", FaultClass.NCCL_ERROR, False, Action.FIX_APPLICATION),
    # https://github.com/KChen-lab/MEDALT/issues/9
    ("slurm", "slurmstepd: error: Detected 1 oom-kill event(s) in step 802100.batch cgroup. Some of your processes "
              "may have been killed by the cgroup out-of-memory handler.\n",
     "slurm-cgroup-oom-kill", FaultClass.OOM_HOST, False, Action.FIX_APPLICATION),
    # https://github.com/nextflow-io/nextflow/issues/5932 (Slurm 23.02 and later)
    ("slurm", "slurmstepd: error: Detected 1 oom_kill event in StepId=11300781.0. Some of the step tasks have been "
              "OOM Killed.\nsrun: error: sdumont6156: task 0: Out Of Memory\n",
     "slurm-cgroup-oom-kill", FaultClass.OOM_HOST, False, Action.FIX_APPLICATION),
    # https://github.com/jtriley/StarCluster/issues/540
    ("container", "2015-07-06 14:48:56,736 PID: 21642 cli.py:284 - ERROR - error occurred in job (id=node053): remote "
                  "command 'source /etc/profile && mount /home' failed with status 32:\nmount.nfs: Connection timed "
                  "out\n",
     "nfs-mount-failed", FaultClass.STORAGE, False, Action.NOTIFY),
    # https://github.com/kubernetes/kubernetes/issues/130145
    ("kubectl", "Status:              Failed\nReason:            UnexpectedAdmissionError\nMessage:         Pod "
                "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. Requested:1, "
                "Available: 0, which is unexpected\n",
     "kubelet-admission-devices-unavailable", FaultClass.NODE, False, Action.NOTIFY),
    # https://github.com/awslabs/awsome-distributed-ai/issues/195 (scontrol show node)
    ("slurm", "Reason=gres/gpu count reported lower than configured (0 < 8)\n",
     "slurm-gres-gpu-count-lower", FaultClass.NODE, False, Action.NOTIFY),
    # https://github.com/ComputeCanada/puppet-magic_castle/issues/27
    ("syslog", "Feb 20 18:59:13 node2.int.rubberducky.calculquebec.cloud slurmd[57977]: fatal: gres.conf duplicate "
               "records for gpu\n",
     "slurmd-gres-config-fatal", FaultClass.NODE, False, Action.NOTIFY),
    # https://github.com/skypilot-org/skypilot/issues/449
    ("nvidia-smi", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
                   "latest NVIDIA driver is installed and running.\n",
     "nvidia-smi-no-driver", FaultClass.NODE, False, Action.NOTIFY),
    # https://github.com/DeepAuto-AI/hip-attention/pull/59
    ("container", "[rank4]:[E421 02:05:38.764490322 ProcessGroupGloo.cpp:143] Gloo connectFullMesh failed with "
                  "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error\n",
     "gloo-connect-full-mesh-failed", FaultClass.NCCL_ERROR, False, Action.RESTART_JOB),
])
def test_a_framework_or_launcher_spelling_names_class_and_call(tmp_path: Path, source: str, text: str, rule: str,
                                                              fault_class: FaultClass, hardware: bool,
                                                              action: Action) -> None:
    incidents = analyze_bundle(tmp_path, source, text, RULES)
    assert len(incidents) == 1, incidents
    top = incidents[0]
    assert (top.root_finding.rule_id, top.fault_class, top.recommended_action) == (rule, fault_class, action)
    assert top.hardware is hardware


def test_the_device_plugin_losing_a_gpu_through_nvml_is_a_lost_gpu(tmp_path: Path) -> None:
    # https://github.com/kubernetes/kubernetes/issues/97131
    text = ("Message:        Pod Allocate failed due to device plugin GetPreferredAllocation rpc failed with err: "
            "rpc error: code = Unknown desc = Unable to retrieve list of available devices: error creating "
            "nvml.Device 5: nvml: GPU is lost, which is unexpected\n")
    [incident] = analyze_bundle(tmp_path, "kubectl", text, RULES)
    assert (incident.root_finding.rule_id, incident.fault_class, incident.hardware) == (
        "kubelet-admission-gpu-lost", FaultClass.GPU_LOST, True)
    assert incident.root_finding.fields["gpu"] == "5"


def test_an_efa_completion_error_is_the_network_not_the_remote_error_it_raises(tmp_path: Path) -> None:
    # https://github.com/NVIDIA/nccl/issues/1928: PyTorch reports ncclRemoteError, the OFI line says why.
    text = ("[rank3]: torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/"
            "c10d/ProcessGroupNCCL.cpp:3763, remote process exited or there was a network error, NCCL version 2.28.8\n"
            "[rank3]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
            "prematurely.\n"
            "[rank3]: Last error:\n"
            "[rank3]: NET/OFI Request 0x7f14cc5b60c0 completed with error. RC: 113. Error: 2 (UNDELIVERABLE). "
            "Completed length: 0\n")
    [incident] = analyze_bundle(tmp_path, "container", text, RULES)
    assert (incident.root_finding.rule_id, incident.fault_class) == ("nccl-ofi-request-error", FaultClass.NETWORK)
    assert incident.root_finding.fields["rc"] == "113"


def test_pytorchs_heartbeat_monitor_is_a_collective_timeout(tmp_path: Path) -> None:
    # https://github.com/sgl-project/sglang/issues/1691
    text = ("[rank0]:[E1019 01:04:03.356947152 ProcessGroupNCCL.cpp:1413] [PG 3 Rank 0] Heartbeat monitor timed out! "
            "Process will be terminated after dumping debug info. workMetaList_.size()=121\n"
            "[rank7]:[E1019 01:04:03.357615073 ProcessGroupNCCL.cpp:1375] [PG 3 Rank 7] First PG on this rank that "
            "detected no heartbeat of its watchdog.\n")
    [incident] = analyze_bundle(tmp_path, "container", text, RULES)
    assert (incident.root_finding.rule_id, incident.fault_class) == (
        "nccl-watchdog-heartbeat-stuck", FaultClass.NCCL_TIMEOUT)
    assert incident.recommended_action is Action.RESTART_JOB


@pytest.mark.parametrize("text", [
    # https://github.com/swz30/Restormer/issues/74
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being "
    "overloaded, please further tune the variable for optimal performance in your application as needed.\n",
    # https://github.com/ofsoundof/GRL-Image-Restoration/issues/27: the store retries before it gives up.
    "trainer/0 [1]:[W socket.cpp:558] [c10d] The client socket has failed to connect to 0.0.0.5:40323 "
    "(errno: 110 - Connection timed out).\n",
])
def test_torchrun_start_up_notices_open_no_incident(tmp_path: Path, text: str) -> None:
    assert analyze_bundle(tmp_path, "container", text, RULES) == []
