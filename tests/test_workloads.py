"""Workloads: exact seed shapes, deterministic sampling, sane committed CSVs, clear errors."""
from __future__ import annotations

import pytest

from rollout_lab.measure import workloads as wl


def test_seed_workloads_exact():
    assert wl.get_workload("short_similar") == [n for n in range(20, 12, -1) for _ in range(4)]
    assert wl.get_workload("short_similar")[:5] == [20, 20, 20, 20, 19]
    assert wl.get_workload("long_tail") == [512] + [16] * 31
    assert wl.get_workload("short_tail") == [20] + [1] * 31
    assert wl.get_workload("moderate_tail") == [128] + [4] * 31
    assert wl.get_workload("spread") == [16 * k for k in range(1, 33)]
    assert wl.get_workload("uniform_128x16") == [16] * 128
    for name in ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread"):
        assert len(wl.get_workload(name)) == 32


def test_every_named_workload_builds():
    for name in wl.WORKLOADS:
        lengths = wl.get_workload(name)
        assert lengths and all(isinstance(n, int) and n >= 1 for n in lengths)


def test_scale_shrinks_with_min_one():
    assert wl.get_workload("long_tail", scale=0.05) == [26] + [1] * 31
    assert wl.get_workload("spread", scale=0.25)[:3] == [4, 8, 12]
    assert all(n >= 1 for n in wl.get_workload("gsm8k_32", scale=0.01))
    with pytest.raises(ValueError, match="scale"):
        wl.get_workload("spread", scale=0.0)


def test_bad_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'nope'.*long_tail.*gsm8k_32"):
        wl.get_workload("nope")
    with pytest.raises(ValueError, match=r"'nope'.*gsm8k"):
        wl.load_lengths("nope")


@pytest.mark.parametrize("dataset,count", [("gsm8k", 1319), ("humaneval", 164)])
def test_csv_counts_and_values(dataset, count):
    lengths = wl.load_lengths(dataset)
    assert len(lengths) == count
    assert all(isinstance(n, int) and n > 0 for n in lengths)
    # chat template adds 29 tokens; raw GSM8K questions are 23..188 Qwen tokens
    assert min(lengths) > 29 and max(lengths) < 4096


def test_optional_csvs_sane():
    for dataset in ("gpqa_diamond", "aime2025"):
        if (wl.PROMPT_LENGTHS / f"{dataset}.csv").is_file():
            assert all(n > 29 for n in wl.load_lengths(dataset))


def test_sampling_is_deterministic():
    a = wl.sample_lengths("gsm8k", 32, seed=7)
    assert a == wl.sample_lengths("gsm8k", 32, seed=7)
    assert a != wl.sample_lengths("gsm8k", 32, seed=8)
    assert wl.get_workload("gsm8k_32") == wl.sample_lengths("gsm8k", 32, seed=wl.SAMPLE_SEED)
    assert len(wl.get_workload("gsm8k_64")) == 64
    assert set(wl.get_workload("humaneval_32")) <= set(wl.load_lengths("humaneval"))
    with pytest.raises(ValueError, match="164"):
        wl.sample_lengths("humaneval", 200)
    assert len(wl.sample_lengths("humaneval", 200, replace=True)) == 200


def test_synthetic_generators():
    a = wl.lognormal_lengths(500, 100, 0.5, 3, 400)
    assert a == wl.lognormal_lengths(500, 100, 0.5, 3, 400)
    assert len(a) == 500 and min(a) >= 1 and max(a) <= 400
    assert 80 <= sorted(a)[250] <= 120
    b = wl.bimodal_lengths(100, 20, 500, long_share=0.1, sigma=0.0, seed=1)
    assert sorted(b) == [20] * 90 + [500] * 10
    assert b == wl.bimodal_lengths(100, 20, 500, long_share=0.1, sigma=0.0, seed=1)
    with pytest.raises(ValueError, match="median"):
        wl.lognormal_lengths(10, 0, 0.5, 0, 100)


def test_padding_share():
    assert wl.padding_share([4, 4]) == 0.0
    assert wl.padding_share([1, 3]) == pytest.approx(1 / 3)
    assert wl.padding_share(wl.get_workload("long_tail")) == pytest.approx(1 - (512 + 31 * 16) / (32 * 512))
    share = wl.mean_padding_share(wl.load_lengths("gsm8k"), 32, num_batches=200)
    assert 0.3 < share < 0.7


def test_lengths_to_prompts():
    specials = [0, 1, 5]
    prompts = wl.lengths_to_prompts([3, 1, 50], vocab_size=8, seed=2, special_ids=specials)
    assert [len(p) for p in prompts] == [3, 1, 50]
    assert all(0 <= t < 8 and t not in specials for p in prompts for t in p)
    assert prompts == wl.lengths_to_prompts([3, 1, 50], vocab_size=8, seed=2, special_ids=specials)
    assert prompts != wl.lengths_to_prompts([3, 1, 50], vocab_size=8, seed=3, special_ids=specials)
    with pytest.raises(ValueError, match="no token ids"):
        wl.lengths_to_prompts([2], vocab_size=2, special_ids=[0, 1])


def test_a_lengths_file_that_is_a_folder_or_holds_none_is_refused_at_the_source(tmp_path):
    with pytest.raises(ValueError, match=f"lengths file {str(tmp_path)!r} is a folder; give a file of prompt "
                                         "lengths \\(numbers, or a CSV with a num_tokens, tokens or length column\\)"):
        wl.read_lengths_file(tmp_path)
    for name, text in (("empty.txt", ""), ("blank.txt", " \n\t\n"), ("header.csv", "num_tokens\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"lengths file '.*{name}' holds no prompt lengths; give numbers"):
            wl.read_lengths_file(tmp_path / name)
    (tmp_path / "two.csv").write_text("name,num_tokens\na,12\nb,7\n")
    assert wl.read_lengths_file(tmp_path / "two.csv") == [12, 7]
