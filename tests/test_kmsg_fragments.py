"""/dev/kmsg on kernels before 4.9 stores each ``pr_cont`` piece of a line as a record of its own, flagged ``c``
(first piece) and ``+`` (later pieces): the agent's kmsg source joins them back into the one line the kernel
printed, and holds a line whose pieces may still arrive instead of shipping half of it."""

from __future__ import annotations

from pathlib import Path

from collector.sources.kernel import KmsgSource, kernel_events, parse_records

# The records of the kernel's own example (commit "kmsg - export "continuation record" flag to /dev/kmsg", 2012,
# Documentation/ABI/testing/dev-kmsg): "[", "0".."3", "]" printed with pr_cont, then the same line printed whole.
DOC_EXAMPLE = (b"4,165,0,-;Free swap = 0kB\n4,166,0,-;Total swap = 0kB\n6,167,0,c;[\n4,168,0,+;0\n4,169,0,+;1\n"
               b"4,170,0,+;2\n4,171,0,+;3\n4,172,0,+;]\n6,173,0,-;[0 1 2 3 ]\n6,174,0,-;Console: colour VGA+ 80x25\n"
               b"6,175,0,-;console [tty0] enabled\n")
NOW = 10_000.0


class _Reader:
    """Hands out one batch of records per poll."""

    def __init__(self, batches: list[bytes]) -> None:
        self.batches = batches

    def read(self) -> bytes:
        if not self.batches:
            raise BlockingIOError
        return self.batches.pop(0)

    def close(self) -> None:
        pass


def _boot(tmp_path: Path) -> Path:
    p = tmp_path / "boot_id"
    p.write_text("b00t\n")
    return p


def test_the_pieces_of_one_line_are_one_event_under_its_first_record() -> None:
    records = parse_records(DOC_EXAMPLE)
    assert [r.flag for r in records[:4]] == ["-", "-", "c", "+"]
    events = kernel_events(records)
    assert [(records[k].seq, text) for k, text in events] == [
        (165, "Free swap = 0kB"), (166, "Total swap = 0kB"), (167, "[0123]"), (173, "[0 1 2 3 ]"),
        (174, "Console: colour VGA+ 80x25"), (175, "console [tty0] enabled")]


def test_a_line_whose_pieces_are_still_arriving_is_held_then_shipped_whole(tmp_path: Path) -> None:
    # The machine-check report prints its TSC, ADDR and MISC parts with pr_cont (arch/x86 mce __print_mce).
    usec = int(NOW * 1e6) - 2000
    first = f"4,10,{usec},-;usb 1-1: new device\n4,11,{usec + 1},c;mce: [Hardware Error]: TSC 0 \n".encode()
    rest = f"4,12,{usec + 2},+;ADDR 1ffe2c0 \n4,13,{usec + 3},+;MISC 8c \n4,14,{usec + 4},-;next line\n".encode()
    reader = _Reader([first])
    src = KmsgSource(node="n1", boot_id_path=_boot(tmp_path), open_reader=lambda _p: reader, clock=lambda: 2e9,
                     monotonic=lambda: NOW)
    poll = src.poll()
    assert [s.text for s in poll.signals] == ["usb 1-1: new device"]
    assert poll.cursors["position"] == {"boot": "b00t", "seq": 10}, "the checkpoint stays before the held line"
    reader.batches.append(rest)
    poll = src.poll()
    assert [(s.id, s.text) for s in poll.signals] == [
        ("n1/kernel/b00t/11", "mce: [Hardware Error]: TSC 0 ADDR 1ffe2c0 MISC 8c "), ("n1/kernel/b00t/14", "next line")]
    assert poll.cursors["position"] == {"boot": "b00t", "seq": 14}


def test_a_plus_record_without_its_first_piece_stays_a_record_of_its_own() -> None:
    # The ring buffer overwrote the "c" piece before it was read: the rest is not glued to an unrelated line.
    records = parse_records(b"6,20,0,-;eth0: link up\n4,22,0,+;ADDR 1ffe2c0 \n")
    assert [text for _, text in kernel_events(records)] == ["eth0: link up", "ADDR 1ffe2c0 "]
