"""The engine's fast paths give the naive matcher's results: ASCII hit lines confirmed and their fields
extracted as bytes, hits of exact group-less patterns taken without RE2, on random mixes of real rule
examples, mutated (tabs, CR, vertical tab, non-ASCII, cut and joined lines) across block edges, through
both the line-list and the byte-buffer paths; and which patterns count as exact."""

from __future__ import annotations

import random

import pytest

from analyzer.engine import _BLOCK, Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.exact import hyperscan_exact
from analyzer.rules import Rule, default_rules_dir, load_rules

NOISE = ["", "step 10 | loss 1.25", "NCCL INFO Connected all rings", "journal: é ü — …", "x", "\t", "a\rb"]
INSERTS = ["é", "—", "\t", " ", "x", "\r", "\v", "0", ":", "€", "\x00"]


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


def _mutate(rng: random.Random, line: str) -> str:
    chars = list(line)
    for _ in range(rng.randrange(4)):
        i = rng.randrange(len(chars) + 1)
        op = rng.random()
        if op < 0.35 and i < len(chars):
            chars[i] = rng.choice(INSERTS)
        elif op < 0.7:
            chars.insert(i, rng.choice(INSERTS))
        elif i < len(chars):
            del chars[i]
    return "".join(chars)


def _mix(rules: list[Rule], seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    examples = [ex for r in rules for ex in r.examples]
    out = []
    for _ in range(n):
        x = rng.random()
        if x < 0.25:
            out.append(rng.choice(examples))
        elif x < 0.5:
            out.append(_mutate(rng, rng.choice(examples)))
        elif x < 0.55:
            out.append(rng.choice(examples) + " " + rng.choice(examples))  # two events on one line
        else:
            out.append(rng.choice(NOISE))
    return out


def _naive(rules: list[Rule], lines: list[str]) -> list[tuple[int, str, dict[str, str]]]:
    return [(h.line, h.rule.id, dict(h.groups)) for h in NaiveMatcher(rules).scan(lines)]


@pytest.mark.parametrize("seed", range(3))
def test_line_lists_give_the_naive_matchers_matches_and_fields(rules: list[Rule], seed: int) -> None:
    lines = _mix(rules, seed, _BLOCK + 700)
    # One block all ASCII (the bytes path), the other with non-ASCII lines (the text path).
    lines[:_BLOCK] = [ln.encode("ascii", "replace").decode() for ln in lines[:_BLOCK]]
    want = _naive(rules, lines)
    got = [(h.line, h.rule.id, dict(h.groups)) for h in MultiMatcher(rules).scan(lines)]
    assert got == want
    assert len(want) > 100


@pytest.mark.parametrize("seed", range(3))
def test_byte_buffers_give_the_naive_matchers_matches_and_fields(rules: list[Rule], seed: int) -> None:
    lines = _mix(rules, 100 + seed, 1500)
    data = "\n".join(ln if i % 7 else ln + "\r" for i, ln in enumerate(lines)).encode("utf-8")
    texts = [raw.decode("utf-8", "replace").rstrip("\r") for raw in data.split(b"\n")]
    starts = [0]
    for raw in data.split(b"\n")[:-1]:
        starts.append(starts[-1] + len(raw) + 1)
    want = [(starts[line], rule, groups) for line, rule, groups in _naive(rules, texts)]
    hits = MultiMatcher(rules).scan_buffer(data)
    assert [(h.start, h.rule.id, dict(h.groups)) for h in hits] == want
    assert all(h.text == texts[starts.index(h.start)] for h in hits)


def test_some_shipped_rules_are_exact_and_skip_confirmation(rules: list[Rule]) -> None:
    exact = [r for r in rules if hyperscan_exact(r.pattern) and not r.regex.groupindex]
    assert len(exact) >= 10
    lines = [ex for r in exact for ex in r.examples]
    assert [(h.line, h.rule.id) for h in MultiMatcher(rules).scan(lines)] == [
        (h.line, h.rule.id) for h in NaiveMatcher(rules).scan(lines)]


@pytest.mark.parametrize(("pattern", "exact"), [
    (r"Xid \d+, GPU has fallen off the bus", True),
    (r"(?i)nccl.*watchdog.*timed out", True),
    (r"^\[rank\d+\]: RuntimeError: CUDA error", True),
    (r"foo\s+bar", False),  # \s runs over a newline into the next line
    (r"state [^ ]+ lost", False),  # so does a negated set that keeps the newline
    (r"[^\n]*fatal", True),
    (r"(?s)a.b", False),
    (r"a\Wb", False),
    (r"[[:alpha:]]+ failed", False),  # RE2 syntax Python reads otherwise
    (r"\QX.Y\E", False),
    (r"end\z", False),
])
def test_which_patterns_are_exact(pattern: str, exact: bool) -> None:
    assert hyperscan_exact(pattern) is exact


def test_an_anchored_rule_matches_a_crlf_file_line(rules: list[Rule]) -> None:
    data = b"noise\r\nNo devices were found\r\nmore\n"
    assert [(h.rule.id, h.text) for h in MultiMatcher(rules).scan_buffer(data)] == [
        ("nvidia-smi-no-devices", "No devices were found")]


def test_a_vertical_tab_does_not_hide_a_line_from_the_scan(rules: list[Rule]) -> None:
    # RE2's \S takes a vertical tab, hyperscan's does not: the database must not be the narrower one.
    line = "RuntimeError: File my\x0b_out/checkpoints/checkpoint_0.pt cannot be opened."
    assert [h.rule.id for h in NaiveMatcher(rules).scan([line])] == ["torch-save-cannot-open"]
    assert [h.rule.id for h in MultiMatcher(rules).scan([line])] == ["torch-save-cannot-open"]


@pytest.mark.parametrize("backend", available_backends(), ids=str)
def test_a_pattern_that_could_run_over_a_newline_finds_every_line(rules: list[Rule], backend: Backend) -> None:
    # message:[^"]+ would run from the first line into the second and hide its match from a scan of
    # the joined batch: every backend must still find both.
    line = "NetworkReady=false reason:NetworkPluginNotReady message:Network plugin returns error: cni not initialized"
    lines = [line, line, "x"]
    assert [(h.line, h.rule.id) for h in MultiMatcher(rules, backend=backend).scan(lines)] == [
        (0, "node-network-plugin-not-ready"), (1, "node-network-plugin-not-ready")]


def test_a_non_space_run_stops_at_a_carriage_return_and_a_line_end(rules: list[Rule]) -> None:
    # The database read "\S" as "[\S\v]", and in a class hyperscan takes "\v" for every vertical space: "\r" and
    # the newline too. A rule it calls exact was then found on a line RE2 does not match, or across two lines.
    split = ["slurmstepd: error: execve(): /tmp/slurmd/job0008\r/slurm_script: No such file or directory",
             "slurmstepd: error: execve(): /tmp/slurmd/job0008", "/slurm_script: No such file or directory"]
    whole = "slurmstepd: error: execve(): /tmp/slurmd/job0008/slurm_script: No such file or directory"
    matcher = MultiMatcher(rules)
    assert [h.rule.id for h in matcher.scan(split) if h.rule.id == "slurmd-job-script-missing"] == []
    assert [(h.line, h.rule.id) for h in matcher.scan([*split, whole])
            if h.rule.id == "slurmd-job-script-missing"] == [(3, "slurmd-job-script-missing")]
