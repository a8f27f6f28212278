from __future__ import annotations

from worker.engine import Engine
from worker.engine.detokenizer import Detokenizer
from worker.model.tokenizer import Tokenizer


def _stream(tok: Tokenizer, text: str, stop: tuple[str, ...] = (), min_tokens: int = 0) -> tuple[list[str], Detokenizer]:
    d = Detokenizer(tok, stop, min_tokens)
    pieces = []
    for i in tok.encode(text):
        d.add(i)
        pieces.append(d.take(final=False))
        if d.stopped:
            break
    d.flush()
    pieces.append(d.take(final=True))
    return pieces, d


def test_streamed_pieces_join_to_the_text(smol_engine: Engine) -> None:
    text = "Héllo wörld! 日本語 🎉👩‍👩‍👧 done."
    pieces, d = _stream(smol_engine.tokenizer, text)
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)  # no half characters ever shown


def test_stop_string_cuts_and_is_never_shown(smol_engine: Engine) -> None:
    pieces, d = _stream(smol_engine.tokenizer, "one two three STOP four five", stop=("STOP",))
    assert d.stopped
    assert "".join(pieces) == d.text == "one two three "


def test_stop_string_across_tokens_with_two_candidates(smol_engine: Engine) -> None:
    pieces, d = _stream(smol_engine.tokenizer, "alpha beta\n\nUser: gamma", stop=("\n\nUser:", "never"))
    assert "".join(pieces) == "alpha beta"


def test_stop_in_generation(smol_engine: Engine) -> None:
    sid = smol_engine.create_session()
    smol_engine.append(sid, text="The quick brown fox")
    g = smol_engine.generate(sid, max_tokens=20, stop=["bear"])
    assert (g.text, g.finish_reason) == (" with a quick brown ", "stop")
    assert g.token_ids == [351, 253, 2365, 6354, 7012]  # the token that completed "bear" is kept in ids
    smol_engine.close(sid)


def test_byte_table_matches_the_tokenizer_on_random_ids(smol_engine: Engine) -> None:
    """The O(1) byte-table path and a full decode agree on any id sequence, specials included."""
    import random

    tok = smol_engine.tokenizer
    assert tok.token_bytes is not None and len(tok.token_bytes) == 49152
    assert tok.token_bytes[2] == b"" and tok.token_bytes[tok.encode(" Paris")[0]] == b" Paris"
    rng = random.Random(5)
    for _ in range(50):
        ids = [rng.randrange(49152) for _ in range(rng.randrange(1, 40))]
        d = Detokenizer(tok)
        pieces = []
        for i in ids:
            d.add(i)
            pieces.append(d.take(final=False))
        d.flush()
        pieces.append(d.take(final=True))
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_stop_strings_count_only_from_min_tokens_on(smol_engine: Engine) -> None:
    """vLLM's min_tokens: a stop string that ends within the first min_tokens tokens does not stop the text; the same
    string ending later does."""
    tok = smol_engine.tokenizer
    text = "one STOP two three four five six STOP seven"
    first = len(tok.encode("one STOP"))
    pieces, d = _stream(tok, text, stop=("STOP",), min_tokens=first + 1)
    assert d.stopped and d.text == "one STOP two three four five six " and "".join(pieces) == d.text
    pieces, d = _stream(tok, text, stop=("STOP",), min_tokens=first)  # ends at its min_tokens-th token: it counts
    assert d.stopped and d.text == "one "
