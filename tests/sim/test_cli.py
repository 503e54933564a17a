"""`tandem sim` on the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main


def test_a_bad_trace_line_is_a_clear_error(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 8, "output_tokens": 4}\nnot json\n')
    assert main(["sim", "--model", "llama-8b", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "line 2: not valid JSON" in err and "Traceback" not in err


def test_bad_arguments_are_explained(capsys):
    assert main(["sim", "--model", "gpt-9"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    assert main(["sim", "--model", "llama-70b", "--tp", "1"]) == 2
    assert "raise tp" in capsys.readouterr().err
    # A pod's ranks run on one node: 32 devices of an 8-device node were simulated.
    assert main(["sim", "--model", "llama-70b", "--tp", "8", "--dp", "4"]) == 2
    assert "needs 32 devices on one node; a h200 node has 8" in capsys.readouterr().err


def test_json_report(tmp_path, capsys):
    args = ["sim", "--model", "llama-8b", "--rate", "5", "--duration", "10", "--json"]
    assert main([*args, "--mode", "disaggregated", "--save-trace", str(tmp_path / "t.jsonl")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["requests"] == doc["summary"]["finished"] > 0
    assert doc["setup"]["mode"] == "disaggregated"
    # The saved trace replays to the same result.
    assert (
        main(
            [
                "sim",
                "--model",
                "llama-8b",
                "--trace",
                str(tmp_path / "t.jsonl"),
                "--json",
                "--mode",
                "disaggregated",
            ]
        )
        == 0
    )
    again = json.loads(capsys.readouterr().out)
    assert again["summary"]["finished"] == doc["summary"]["finished"]
    assert again["summary"]["ttft"]["p50"] == doc["summary"]["ttft"]["p50"]


def test_deployment_yaml(tmp_path, capsys):
    path = tmp_path / "md.yaml"
    path.write_text(
        "kind: ModelDeployment\nmetadata: {name: m}\nspec:\n  model: {path: smollm2}\n"
        "  mode: Disaggregated\n  prefill: {replicas: 1, maxReplicas: 2}\n"
        "  decode: {replicas: 2, maxReplicas: 3}\n"
    )
    args = ["sim", "--model", "llama-8b", "--deployment", str(path), "--rate", "2"]
    assert main([*args, "--duration", "10", "--json"]) == 0
    roles = json.loads(capsys.readouterr().out)["setup"]["roles"]
    assert roles["decode"]["replicas"] == 2 and roles["prefill"]["max"] == 2
    path.write_text("kind: ModelDeployment\nmetadata: {name: m}\nspec: {mode: Sideways}\n")
    assert main(["sim", "--model", "llama-8b", "--deployment", str(path)]) == 2
    assert "spec.mode" in capsys.readouterr().err


def test_a_deployment_whose_pods_ask_for_other_gpus_than_simulated_is_refused(capsys):
    # Its pods' GPUs were ignored: a 1-GPU manifest was simulated on 4 GPUs a pod.
    manifest = Path(__file__).parents[2] / "examples/llama-8b-disaggregated.yaml"  # 1 GPU a pod
    argv = ["sim", "--deployment", str(manifest), "--rate", "1", "--duration", "5"]
    assert main([*argv, "--model", "llama-70b", "--tp", "4"]) == 2
    assert "spec.prefill pods ask for 1 GPUs, the run simulates 4 a pod" in capsys.readouterr().err
    assert main([*argv, "--model", "llama-8b"]) == 0


def test_a_cpu_deployment_is_refused_on_a_gpu_device(capsys):
    # It was simulated on H200s without a word: an answer about another deployment.
    manifest = Path(__file__).parents[2] / "examples/smollm2-cpu.yaml"  # CPU limits, no GPU
    argv = ["sim", "--deployment", str(manifest), "--model", "smollm2-135m", "--rate", "1",
            "--duration", "5"]  # fmt: skip
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert "spec.normal pods ask for CPUs and no GPU, the run simulates GPUs" in said
    assert main([*argv, "--device", "cpu"]) == 0


@pytest.mark.parametrize(
    ("flag", "path", "problem"),
    [
        ("--save-trace", "{tmp}", "is a folder, not a file"),
        ("--save-trace", "/proc/nope/t.jsonl", "cannot write"),
        ("--plot", "{tmp}/file", "is not a folder"),
        ("--plot", "/proc/nope", "cannot write"),
    ],
)
def test_an_unwritable_output_is_refused_before_the_simulation(
    tmp_path, capsys, flag, path, problem
):
    (tmp_path / "file").write_text("")
    path = path.format(tmp=tmp_path)
    # Refused before the workload is made and simulated (then, --plot failed after it).
    argv = ["sim", "--model", "llama-8b", "--rate", "2", "--duration", "10", flag, path]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: error: {flag} {path}: ") and err.count("\n") == 1
    assert problem in err


def test_a_trace_is_saved_into_a_new_folder(tmp_path, capsys):
    path = tmp_path / "new" / "t.jsonl"
    args = ["sim", "--model", "llama-8b", "--rate", "2", "--duration", "5", "--json"]
    assert main([*args, "--save-trace", str(path)]) == 0
    requests = json.loads(capsys.readouterr().out)["summary"]["requests"]
    assert len(path.read_text().splitlines()) == requests > 0


def test_a_deployments_kv_cache_memory_sizes_the_simulated_pool(tmp_path, capsys):
    # It was ignored: a deployment that caps its KV got figures for the devices' whole
    # memory, many times too optimistic.
    def run(engine: str) -> dict:
        path = tmp_path / "md.yaml"
        path.write_text(
            "kind: ModelDeployment\nmetadata: {name: m}\nspec:\n  model: {path: smollm2}\n"
            f"  engine: {{maxModelLen: 8192{engine}}}\n  normal: {{replicas: 1}}\n"
        )
        args = ["sim", "--model", "llama-8b", "--deployment", str(path), "--rate", "4"]
        assert (
            main([*args, "--duration", "20", "--input", "4000", "--output", "200", "--json"]) == 0
        )
        return json.loads(capsys.readouterr().out)

    whole, capped = run(""), run(", kvCacheMemory: 2Gi")  # 16,384 tokens of llama-8b's KV
    assert capped["summary"]["ttft"]["p50"] > whole["summary"]["ttft"]["p50"]
    too_small = tmp_path / "small.yaml"
    too_small.write_text(
        "kind: ModelDeployment\nmetadata: {name: m}\nspec:\n  model: {path: smollm2}\n"
        "  engine: {maxModelLen: 8192, kvCacheMemory: 512Mi}\n  normal: {replicas: 1}\n"
    )
    assert main(["sim", "--model", "llama-8b", "--deployment", str(too_small)]) == 2
    assert "the KV cache of engine.kvCacheMemory holds 4096 tokens" in capsys.readouterr().err


def test_a_reader_that_closes_the_output_early_fails_nothing(tmp_path):
    # `| head`: the plots' "wrote" lines met the closed pipe and read as the plots
    # failing to write (exit 1, "cannot write (Broken pipe)").
    plots = tmp_path / "plots"
    argv = ["sim", "--model", "llama-8b", "--rate", "1", "--duration", "20", "--plot", str(plots)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "tandem.cli", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().startswith(b"tandem sim: llama-8b")
    proc.stdout.close()  # what head does once it has its line
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    assert proc.stderr.read() == b""
    assert sorted(p.suffix for p in plots.iterdir()) == [".png", ".png"]
