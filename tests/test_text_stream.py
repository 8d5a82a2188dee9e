from engine.runtime.text_stream import TextStream


def test_multibyte_characters_are_released_whole():
    s = TextStream()
    data = "né✓".encode()
    out = [s.feed(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + s.finish() == "né✓"
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_across_tokens_is_cut_and_never_shown():
    s = TextStream(stop=("\nUser:",))
    shown = [s.feed(b) for b in [b"Hello", b"\nUs", b"er", b": hi"]]
    assert "".join(shown) == "Hello"
    assert s.stopped and s.text == "Hello"


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    s = TextStream(stop=("END",))
    assert s.feed(b"the EN") == "the "
    assert s.feed(b"d") == "ENd"
    assert s.finish() == ""
    assert s.text == "the ENd"
