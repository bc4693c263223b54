"""The soak benchmark's sustained-against-peak arithmetic (benchmarks/soak_run.py), on made-up description times."""

from benchmarks.soak_run import sustained


def test_sustained_compares_the_first_steady_span_with_the_last():
    # A minute of warm-up at 1 img/s, then 10 img/s for 5 minutes, then 8 img/s for a little over 5 minutes.
    stamps = [i * 1.0 for i in range(60)]
    stamps += [60 + i * 0.1 for i in range(3000)]
    stamps += [360 + i * 0.125 for i in range(2480)]
    rates = sustained(stamps, window_s=60, span_s=300)
    assert rates["windows"][0] == 1.0 and rates["windows"][1] == 10.0 and rates["windows"][-2] == 8.0
    assert rates["first_span"] == 10.0 and rates["last_span"] == 8.0 and rates["last_over_first"] == 0.8


def test_a_short_run_has_no_spans():
    rates = sustained([i * 0.5 for i in range(600)], window_s=60, span_s=300)
    assert rates["first_span"] is None and rates["last_over_first"] is None and len(rates["windows"]) == 5


def test_the_last_span_ends_where_the_input_ran_out():
    # 10 img/s for 11 minutes while decode still has documents, then a drain at 30 img/s once it has none.
    stamps = [i * 0.1 for i in range(6600)] + [660 + i / 30 for i in range(1800)]
    rates = sustained(stamps, window_s=60, span_s=300, input_end=660)
    assert rates["last_span"] == 10.0 and rates["last_over_first"] == 1.0
    assert sustained(stamps, window_s=60, span_s=300)["last_span"] == 14.0  # the drain counted in
