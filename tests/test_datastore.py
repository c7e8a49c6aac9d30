

def test_data_build_builds_the_stores_ahead_of_a_run_once(tmp_path, capsys):
    from fivecut.cli import main

    sources = write_formats(tmp_path / "data")
    argv = ["data", "build", "--set", f"data.source={json.dumps([sources['jsonl.gz'], sources['saved']])}"]
    argv += ["--set", 'data.tokenizer="gpt2"', "--set", f'data.cache_dir="{tmp_path / "cache"}"']
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2 and all("1,849 tokens, 45 documents" in line for line in lines), out
    assert err.count("fivecut: built token store") == 2
    assert main(argv) == 0 and "built token store" not in capsys.readouterr().err  # reused
