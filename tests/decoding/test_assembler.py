from __future__ import annotations

import pytest

from airflow_provider_pgdecode.decoding.assembler import PreparedTransaction, Transaction, TransactionAssembler
from airflow_provider_pgdecode.decoding.events import (
    Begin,
    Change,
    Commit,
    CommitPrepared,
    Message,
    Operation,
    Origin,
    Prepare,
    RollbackPrepared,
    RowImage,
    StreamDataWithheld,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool
from airflow_provider_pgdecode.errors import AssemblyError


def insert(lsn: int, xid: int, value: int) -> Change:
    return Change(Lsn(lsn), xid, Operation.INSERT, "public", "t", None, RowImage(("id",), ("integer",), (str(value),)))


def values(txn: Transaction) -> list[str]:
    return [item.new.values[0] for item in txn if isinstance(item, Change)]


def run(assembler: TransactionAssembler, events) -> list:
    return list(assembler.feed_all(events))


def test_transactions_come_out_at_commit_in_commit_order() -> None:
    asm = TransactionAssembler()
    out = run(
        asm,
        [
            Begin(Lsn(10), 1),
            insert(11, 1, 1),
            insert(12, 1, 2),
            Commit(Lsn(20), 1),
            Begin(Lsn(5), 2),
            insert(6, 2, 3),
            Commit(Lsn(30), 2),
        ],
    )
    assert [t.commit_lsn for t in out] == [Lsn(20), Lsn(30)]
    assert [values(t) for t in out] == [["1", "2"], ["3"]]
    assert asm.safe_lsn == Lsn(30)
    asm.finish()


def test_empty_transactions_advance_but_do_not_come_out() -> None:
    asm = TransactionAssembler()
    assert run(asm, [Begin(Lsn(1), 1), Commit(Lsn(2), 1)]) == []
    assert asm.safe_lsn == Lsn(2)
    assert asm.stats.empty_transactions == 1


def test_transactional_messages_belong_to_their_transaction_non_transactional_come_out_at_once() -> None:
    asm = TransactionAssembler()
    out = run(
        asm,
        [
            Begin(Lsn(1), 1),
            Message(Lsn(2), 1, True, "p", b"in"),
            Message(Lsn(3), 0, False, "p", b"now"),
            insert(4, 1, 1),
            Commit(Lsn(5), 1),
        ],
    )
    assert isinstance(out[0], Message) and out[0].content == b"now"
    assert [type(i).__name__ for i in out[1]] == ["Message", "Change"]


def test_prepared_transaction_held_until_commit_prepared_in_a_later_batch() -> None:
    first = TransactionAssembler()
    assert run(first, [Begin(Lsn(1), 7), insert(2, 7, 1), Prepare(Lsn(3), 7, "g1")]) == []
    first.finish()
    pending = first.pending()
    assert [(p.gid, p.xid, p.prepare_lsn) for p in pending] == [("g1", 7, Lsn(3))]
    assert first.safe_lsn == Lsn(3)

    second = TransactionAssembler(pending)
    out = run(second, [Begin(Lsn(4), 8), insert(5, 8, 2), Commit(Lsn(6), 8), CommitPrepared(Lsn(9), 7, "g1")])
    assert [(t.commit_lsn, t.gid, values(t)) for t in out] == [(Lsn(6), None, ["2"]), (Lsn(9), "g1", ["1"])]
    assert out[1].prepare_lsn == Lsn(3)
    assert second.pending() == []


def test_rollback_prepared_drops_the_transaction() -> None:
    asm = TransactionAssembler()
    out = run(asm, [Begin(Lsn(1), 7), insert(2, 7, 1), Prepare(Lsn(3), 7, "g1"), RollbackPrepared(Lsn(4), 7, "g1")])
    assert out == [] and asm.pending() == []
    assert asm.safe_lsn == Lsn(4)
    assert [(r.gid, r.committed) for r in asm.stats.resolved] == [("g1", False)]


def test_rollback_prepared_of_an_unseen_prepare_is_harmless() -> None:
    asm = TransactionAssembler()
    assert run(asm, [RollbackPrepared(Lsn(4), 7, "never")]) == []
    assert asm.stats.resolved[0].known is False


def test_repeated_prepare_is_kept_once() -> None:
    first = TransactionAssembler()
    run(first, [Begin(Lsn(1), 7), insert(2, 7, 1), Prepare(Lsn(3), 7, "g1")])
    second = TransactionAssembler(first.pending())
    out = run(second, [Begin(Lsn(1), 7), insert(2, 7, 1), Prepare(Lsn(3), 7, "g1"), CommitPrepared(Lsn(9), 7, "g1")])
    assert len(out) == 1 and values(out[0]) == ["1"]
    assert second.stats.duplicate_prepares == 1


def test_same_gid_reused_by_another_transaction_is_a_different_key() -> None:
    asm = TransactionAssembler()
    out = run(
        asm,
        [
            Begin(Lsn(1), 7),
            insert(2, 7, 1),
            Prepare(Lsn(3), 7, "g"),
            CommitPrepared(Lsn(4), 7, "g"),
            Begin(Lsn(5), 9),
            insert(6, 9, 2),
            Prepare(Lsn(7), 9, "g"),
        ],
    )
    assert [values(t) for t in out] == [["1"]]
    assert [(p.gid, p.xid) for p in asm.pending()] == [("g", 9)]


def test_full_replay_of_a_prepare_before_the_consistent_point_is_applied_once() -> None:
    asm = TransactionAssembler()
    out = run(asm, [Begin(Lsn(1), 7), insert(2, 7, 1), Prepare(Lsn(3), 7, "old"), CommitPrepared(Lsn(4), 7, "old")])
    assert len(out) == 1 and out[0].commit_lsn == Lsn(4)


def test_commit_prepared_without_any_state_fails_loudly() -> None:
    asm = TransactionAssembler()
    with pytest.raises(AssemblyError, match="never seen as prepared.*re-snapshot"):
        run(asm, [CommitPrepared(Lsn(4), 7, "lost")])


def test_without_xids_gid_alone_matches() -> None:
    asm = TransactionAssembler()
    out = run(
        asm, [Begin(Lsn(1), None), insert(2, None, 1), Prepare(Lsn(3), None, "g"), CommitPrepared(Lsn(4), None, "g")]
    )
    assert len(out) == 1


def test_resume_after_drops_what_an_earlier_batch_handled() -> None:
    # The slot is behind the checkpoint (a confirm failed): rows up to LSN 20 were staged before.
    first = TransactionAssembler()
    run(first, [Begin(Lsn(8), 3), insert(9, 3, 0), Prepare(Lsn(10), 3, "p")])
    asm = TransactionAssembler(first.pending(), resume_after=Lsn(20))
    out = run(
        asm,
        [
            Begin(Lsn(1), 1),
            insert(2, 1, 1),
            Commit(Lsn(5), 1),  # staged before
            Begin(Lsn(6), 2),
            insert(7, 2, 2),
            Prepare(Lsn(8), 2, "q"),  # prepared and resolved before
            Begin(Lsn(8), 3),
            insert(9, 3, 0),
            Prepare(Lsn(10), 3, "p"),  # still pending: duplicate
            CommitPrepared(Lsn(12), 2, "q"),  # resolved before
            Message(Lsn(15), 0, False, "hb", b""),  # seen before
            Begin(Lsn(21), 4),
            insert(22, 4, 4),
            Commit(Lsn(25), 4),  # new
            CommitPrepared(Lsn(30), 3, "p"),  # new
        ],
    )
    assert [(t.commit_lsn, values(t)) for t in out] == [(Lsn(25), ["4"]), (Lsn(30), ["0"])]
    assert asm.stats.already_handled == 4
    assert asm.pending() == []


def test_truncate_is_an_item_of_its_transaction() -> None:
    asm = TransactionAssembler()
    out = run(
        asm,
        [
            Begin(Lsn(1), 1),
            insert(2, 1, 1),
            Truncate(Lsn(3), 1, (("public", "t"),)),
            insert(4, 1, 2),
            Commit(Lsn(5), 1),
        ],
    )
    assert [type(i).__name__ for i in out[0]] == ["Change", "Truncate", "Change"]


@pytest.mark.parametrize(
    "events, message",
    [
        ([insert(1, 1, 1)], "outside any transaction"),
        ([Commit(Lsn(1), 1)], "without a BEGIN"),
        ([Begin(Lsn(1), 1), Begin(Lsn(2), 2)], "still open"),
        ([Begin(Lsn(1), 1), Commit(Lsn(2), 2)], "while transaction 1 is open"),
        ([Message(Lsn(1), 1, True, "p", b"")], "skip-empty-xacts"),
        ([Begin(Lsn(1), 1), StreamDataWithheld(Lsn(2), 1, "change")], "cannot carry streamed"),
    ],
)
def test_invalid_sequences_fail_with_a_reason(events, message: str) -> None:
    with pytest.raises(AssemblyError, match=message):
        run(TransactionAssembler(), events)


def test_input_cut_inside_a_transaction_is_detected() -> None:
    asm = TransactionAssembler()
    run(asm, [Begin(Lsn(1), 1), insert(2, 1, 1)])
    with pytest.raises(AssemblyError, match="neither committed nor prepared"):
        asm.finish()


def test_large_transaction_spills_and_keeps_order(tmp_path) -> None:
    asm = TransactionAssembler(memory_items=100, spill_dir=tmp_path)
    events = [Begin(Lsn(1), 1)] + [insert(10 + i, 1, i) for i in range(1050)] + [Commit(Lsn(5000), 1)]
    (txn,) = run(asm, events)
    assert txn.items.spilled
    assert len(txn) == 1050
    assert values(txn) == [str(i) for i in range(1050)]
    assert list(tmp_path.iterdir())  # spilled to disk, not memory
    txn.items.discard()
    assert not list(tmp_path.iterdir())


def test_prepared_transaction_round_trips_through_its_saved_form(tmp_path) -> None:
    asm = TransactionAssembler(memory_items=3, spill_dir=tmp_path)
    events = [Begin(Lsn(1), 7)] + [insert(2 + i, 7, i) for i in range(10)]
    events += [Message(Lsn(20), 7, True, "m", b"\x00\xff"), Truncate(Lsn(21), 7, (("public", "t"),), True, False)]
    run(asm, events + [Prepare(Lsn(30), 7, "g'1")])
    (held,) = asm.pending()
    path = tmp_path / "held.jsonl.gz"
    count = held.items.save(path)
    header = held.header()
    restored = PreparedTransaction.from_header(header, ItemSpool.load(path, count))
    assert restored.key == held.key and restored.prepare_lsn == Lsn(30)
    assert list(restored.items) == list(held.items)
    out = run(TransactionAssembler([restored]), [CommitPrepared(Lsn(40), 7, "g'1")])
    assert len(out[0]) == 12


def test_drop_origins_drops_replicated_transactions_plain_and_prepared() -> None:
    # pgoutput before 16 has no origin option: the extract drops what carries an Origin itself.
    events = [
        Begin(Lsn(1), 10),
        Origin(Lsn(2), 10, "upstream", Lsn(0xAB)),
        insert(3, 10, 1),
        Commit(Lsn(4), 10),
        Begin(Lsn(5), 11),
        insert(6, 11, 2),
        Commit(Lsn(7), 11),
        Begin(Lsn(8), 12),
        Origin(Lsn(9), 12, "upstream", Lsn(0xAC)),
        insert(10, 12, 3),
        Prepare(Lsn(11), 12, "g"),
        CommitPrepared(Lsn(12), 12, "g"),
    ]
    kept = TransactionAssembler(drop_origins=True)
    assert [values(t) for t in run(kept, events)] == [["2"]]
    assert kept.stats.origin_dropped == 2 and kept.safe_lsn == Lsn(12)
    everything = TransactionAssembler()
    assert [t.origin for t in run(everything, events)] == ["upstream", None, "upstream"]
