"""REST: suffix-array lookup, trie, tree verification, greedy exactness."""

import json

import numpy as np
import pytest
import torch

from draftctl.controllers import Action, Controller, make_controller
from draftctl.decode import DecodeInputError, SpeculativeDecoder, generate
from draftctl.decode.features import FeatureRecord, SequenceState
from draftctl.decode.tree import accepted_path, tree_pattern
from draftctl.drafters.retrieval import RetrievalDrafter
from draftctl.retrieval.datastore import SEPARATOR, Datastore, DatastoreError, write_datastore
from draftctl.retrieval.features import depth_first, prune, trie_records, tried_chain
from draftctl.retrieval.retriever import Candidates, RetrievalConfig, Retriever, build_trie
from tests.conftest import make_decoder
from tests.test_models import word_tokenizer


def store(tmp_path, tokens, name="ds"):
    manifest = {"tokenizer": "test", "tokenizer_sha256": "x"}
    write_datastore(np.asarray(tokens, dtype=np.uint32), tmp_path / name, manifest)
    return Datastore(tmp_path / name)


def test_suffix_array_lookup_matches_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=3000)
    tokens[[500, 1700]] = SEPARATOR
    data = store(tmp_path, tokens)
    for _ in range(200):
        length = int(rng.integers(1, 6))
        start = int(rng.integers(0, len(tokens) - length))
        pattern = tokens[start:start + length] if rng.random() < 0.7 \
            else rng.integers(0, 6, size=length)
        lo, hi = data.find(pattern)
        where = sorted(int(data.suffix_array[i]) for i in range(lo, hi))
        brute = [i for i in range(len(tokens) - length + 1)
                 if np.array_equal(tokens[i:i + length], pattern)]
        assert where == brute


def test_trie_counts_prefixes_and_keeps_parents_first():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, -1, -1], [1, 7, -1]])
    trie = build_trie(rows, max_nodes=4)
    nodes = {}
    for k in range(len(trie)):
        prefix = (nodes[int(trie.parents[k])] if trie.parents[k] >= 0 else ()) + (
            int(trie.tokens[k]),)
        nodes[k] = prefix
        brute = sum(tuple(r[:len(prefix)]) == prefix for r in rows.tolist())
        assert trie.counts[k] == brute and trie.depths[k] == len(prefix)
        assert trie.parents[k] < k
    assert [nodes[k] for k in range(len(trie))] == [(1,), (1, 2), (1, 2, 3), (5,)]


def test_tree_mask_and_accepted_path_on_a_hand_built_trie():
    # root -> a(10) -> b(11); root -> c(12) -> d(13)
    parents = np.array([-1, 0, -1, 2])
    allowed = tree_pattern(parents)
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                           [1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expect)
    tokens = np.array([10, 11, 12, 13])
    # argmax after root, a, b, c, d
    assert accepted_path(tokens, parents, [12, 0, 0, 13, 99]) == [2, 3]
    assert accepted_path(tokens, parents, [10, 5, 0, 0, 0]) == [0]
    assert accepted_path(tokens, parents, [77, 0, 0, 0, 0]) == []


def test_greedy_rest_output_equals_plain_decoding(tiny_models, tmp_path):
    target, _ = tiny_models
    plain = make_decoder(target, None, max_new_tokens=30)
    prompts = [[5, 6, 7, 8, 9], [40, 2, 2, 17, 88, 3], [1, 2]]
    outputs = [generate(plain, p, make_controller("none")).output_ids for p in prompts]
    rng = np.random.default_rng(1)
    corpus = []
    for p, out in zip(prompts, outputs):  # the right continuations, and noisy ones
        corpus += [*p, *out, SEPARATOR, *p, *rng.integers(0, 97, 10), SEPARATOR]
    corpus += list(rng.integers(0, 97, 2000))
    retriever = Retriever(store(tmp_path, corpus), RetrievalConfig(max_nodes=16))
    decoder = make_decoder(target, RetrievalDrafter(retriever), max_new_tokens=30)
    for prompt, expected in zip(prompts, outputs):
        for spec in ("static:10", "static:2", "none"):
            result = generate(decoder, prompt, make_controller(spec))
            assert result.output_ids == expected, spec
            if spec == "static:10":
                assert sum(r.n_accepted for r in result.rounds) >= 10
                assert len(result.rounds) < len(expected)
            assert all(r.drafted <= 16 and r.n_accepted <= (10 if spec != "static:2" else 2)
                       for r in result.rounds)
        # Feature-reading controllers prune the trie; the output stays exact.
        full = generate(decoder, prompt, make_controller("static:10"))
        for spec in ("svip:0.5", "confidence:0.6", "pmin:0.5"):
            pruned = generate(decoder, prompt, make_controller(spec))
            assert pruned.output_ids == expected, spec
            assert all(len(r.features) == r.drafted == len(r.tree_parents)
                       for r in pruned.rounds)
        strict = generate(decoder, prompt, make_controller("confidence:0.99"))
        assert strict.output_ids == expected
        assert sum(r.drafted for r in strict.rounds) < sum(r.drafted for r in full.rounds)
        assert sum(r.controller_calls for r in strict.rounds) > 0
    with pytest.raises(DecodeInputError, match="does not apply to tree"):
        generate(decoder, prompts[0], make_controller("oracle"))


def test_rest_refuses_sampling(tiny_models, tmp_path):
    target, _ = tiny_models
    retriever = Retriever(store(tmp_path, [1, 2, 3, 4]))
    config = make_decoder(target, None, temperature=0.7).config
    with pytest.raises(DecodeInputError, match="no lossless multi-candidate sampling rule"):
        SpeculativeDecoder(target, RetrievalDrafter(retriever), vocab_size=97, eos_ids=(),
                           context_length=256, config=config)


def test_datastore_build_and_tokenizer_mismatch(tmp_path):
    from draftctl.retrieval.datastore import build_datastore

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("w1 w2 w3 w4 w1 w2 w3 w5")
    (tmp_path / "corpus" / "b.py").write_text("w7 w1 w2")
    tokenizer = word_tokenizer()
    manifest = build_datastore(tokenizer, tmp_path / "ds", [str(tmp_path / "corpus")],
                               tokenizer_spec="words", progress=False)
    assert manifest["tokens"] == 8 + 3 + 2 and len(manifest["files"]) == 2
    data = Datastore(tmp_path / "ds", tokenizer)
    w1w2 = tokenizer("w1 w2", add_special_tokens=False)["input_ids"]
    lo, hi = data.find(w1w2)
    assert hi - lo == 3
    other = word_tokenizer(["<unk>", "<eos>"] + [f"x{i}" for i in range(50)])
    with pytest.raises(DatastoreError, match="built with another tokenizer"):
        Datastore(tmp_path / "ds", other)
    with pytest.raises(DatastoreError, match="neither a file, a folder nor a built-in"):
        build_datastore(tokenizer, tmp_path / "x", ["missing-dir"])
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DatastoreError, match="unknown datastore format"):
        Datastore(tmp_path / "ds")


def hand_trie():
    # root -> a (6) -> c (4), root -> b (2), a -> d (1); 10 occurrences counted
    return Candidates(tokens=np.array([10, 11, 12, 13]), parents=np.array([-1, -1, 0, 0]),
                      depths=np.array([1, 1, 2, 2]), counts=np.array([6, 2, 4, 1]),
                      match_len=3, occurrences=10)


def test_trie_records_describe_the_tries_own_distribution():
    records = trie_records(hand_trie(), SequenceState(seq_len=20, prev_accepted=1,
                                                      prev_drafted=3))
    a, b, c, d = records
    assert [r.draft_pos for r in records] == [1, 1, 2, 2]
    assert [r.seq_pos for r in records] == [20, 20, 21, 21]
    assert (a.token_share, b.token_share) == (0.6, 0.2)
    assert c.token_share == pytest.approx(4 / 6) and d.token_share == pytest.approx(1 / 6)
    assert (a.node_share, c.node_share) == (0.6, 0.4)
    # Below the root: q = (0.6, 0.2) and 0.2 of continuations that end or were cut.
    assert a.top_probs[:3] == (0.6, 0.2, 0.0) and a.top_probs == b.top_probs
    assert a.entropy == pytest.approx(-(0.6 * np.log(0.6) + 2 * 0.2 * np.log(0.2)))
    assert c.cum_top1 == pytest.approx(0.6 * 4 / 6)
    assert (c.suffix_len, c.occurrences, c.prev_accepted, c.prev_drafted) == (3, 10, 1, 3)
    assert FeatureRecord.from_vector(c.to_vector()) == c


class Scripted(Controller):
    def __init__(self, actions):
        self.actions = actions
        self.asked = []

    def decide(self, record):
        self.asked.append(record.token_share)
        return self.actions[len(self.asked) - 1]


def test_prune_keeps_stops_and_discards_subtrees():
    trie = hand_trie()
    records = trie_records(trie, SequenceState(5))
    # a: STOP (kept, children dropped unasked); b: CONTINUE
    ctl = Scripted([Action.STOP, Action.CONTINUE])
    keep, calls = prune(records, trie.parents.tolist(), ctl)
    assert keep.tolist() == [True, True, False, False] and calls == 2
    # a: DISCARD drops its subtree; b kept
    keep, calls = prune(records, trie.parents.tolist(), Scripted([Action.DISCARD,
                                                                 Action.CONTINUE]))
    assert keep.tolist() == [False, True, False, False] and calls == 2
    # Depth first: a, its children c and d, then b.
    ctl = Scripted([Action.CONTINUE, Action.DISCARD, Action.STOP, Action.CONTINUE])
    keep, _ = prune(records, trie.parents.tolist(), ctl)
    assert ctl.asked == pytest.approx([0.6, 4 / 6, 1 / 6, 0.2])
    assert keep.tolist() == [True, True, False, True]
    kept = trie.select(keep)
    assert kept.tokens.tolist() == [10, 11, 13] and kept.parents.tolist() == [-1, -1, 0]
    with pytest.raises(ValueError, match="without its parent"):
        trie.select(np.array([False, True, True, False]))
    assert tried_chain([0, 2], trie.parents.tolist()) == [0, 2]
    assert tried_chain([0], trie.parents.tolist()) == [0, 2]  # c was tried and rejected
    assert tried_chain([], trie.parents.tolist()) == [0]


def test_depth_first_order_finishes_each_subtree():
    assert depth_first([-1, -1, 0, 1, 0, 2]) == [0, 2, 5, 4, 1, 3]
    assert depth_first([]) == []


def test_the_path_rule_multiplies_scores_along_each_branch_of_a_tree():
    """Under a path-rule controller each node's value is the product of the scores from the
    root to it, whatever was asked before it (asked parents first but breadth first, c would
    read b's score)."""
    from draftctl.controllers.learned import ScoreThreshold

    class Spy(ScoreThreshold):
        def decide(self, record):
            action = super().decide(record)
            self.seen.append((self.path[-1], action))
            return action

    trie = hand_trie()
    records = trie_records(trie, SequenceState(5))
    ctl = Spy(lambda x: float(x[0, 0]), ["token_share"], threshold=0.35, stop="path")
    ctl.seen = []
    ctl.decide(records[2])  # a stale path from an earlier round must not leak in
    ctl.seen = []
    keep, calls = prune(records, trie.parents.tolist(), ctl)
    values, actions = zip(*ctl.seen)
    assert values == pytest.approx([0.6, 0.6 * 4 / 6, 0.6 * 1 / 6, 0.2])  # a, c, d, b
    assert actions == (Action.CONTINUE, Action.CONTINUE, Action.STOP, Action.STOP)
    assert keep.all() and calls == 4
