"""The documentation: the MkDocs site builds with no warning, every page is in its nav, the
README stays a front door, and the README's headline numbers are those of the JSON they cite."""

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
README_MAX_LINES = 200


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Headline numbers" in home and "README.md" not in home  # the README, rendered (docs/hooks.py)
    # flags.md's table is generated from the config (docs/hooks.py): every field, under its topic
    from grpo_fast.cli import help_topics

    flags = (tmp_path / "site" / "flags" / "index.html").read_text(encoding="utf-8")
    for topic, names in help_topics().items():
        assert f"{topic[0].upper()}{topic[1:]}" in flags, topic
        assert all(f"--{name.replace('_', '-')}" in flags for name in names), topic
    assert "--num-generations" in flags and "<!-- flags -->" not in flags


def nav_pages(entries):
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from nav_pages(value)
        else:
            yield value


def test_every_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)  # plain YAML: no !!python tags
    nav = list(nav_pages(config["nav"]))
    pages = sorted(name for name in os.listdir(DOCS) if name.endswith(".md"))
    assert sorted(nav) == pages, "docs/*.md and mkdocs.yml's nav must list the same pages"
    assert len(nav) == len(set(nav))


def test_readme_is_a_front_door():
    readme = read("README.md")
    lines = readme.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move a topic to docs/"
    # .ci/run runs the line after "# run the tests"; the main job's line stays beside it.
    for marker, command in [("# run the main job", "grpo-fast train"), ("# run the tests", "python -m pytest")]:
        assert marker in lines, marker
        assert command in lines[lines.index(marker) + 1]
    for page in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert os.path.isfile(os.path.join(ROOT, page)), page


def test_nothing_cites_outside_the_repository():
    texts = {"README.md": read("README.md")}
    texts.update({f"docs/{name}": read("docs", name) for name in os.listdir(DOCS) if name.endswith(".md")})
    for name, text in texts.items():
        assert "../" not in text, f"{name} cites a path outside its folder or the repository"


# The headline table: each row cites one JSON file of benchmarks/results/ (its last cell); the
# numbers its "number" cell prints, in order, recomputed from that file with the same rounding.
def ops_loss_bf16(data):
    rows = {(r["name"], r["impl"]): r for r in data["results"]}
    plain, fused, compiled = (rows["loss_bf16_32k", impl] for impl in ("plain", "fused", "compiled"))
    return [
        f"{plain['median_s'] / fused['median_s']:.2f}x",
        f"{plain['median_s'] / compiled['median_s']:.2f}x",
        f"{fused['peak_bytes'] / plain['peak_bytes']:.2f}x",
    ]


def fused_linear(data):
    rows = {r["impl"]: r for r in data["results"]}
    plain = rows["plain"]
    return [
        f"{rows[impl][key] / plain[key]:{spec}}x"
        for impl in ("fused", "compiled")
        for key, spec in (("peak_bytes", ".3f"), ("median_s", ".2f"))
    ]


def trl_update(data):
    ours = data["results"]["update"]["grpo_fast"]
    return [f"{ours['time_vs_trl']:.2f}x", f"{ours['peak_vs_trl']:.2f}x"]


def trainer_speed(data):
    results = data["results"]
    return [
        f"{results['vllm']['steps_per_s'] / results['trl_vllm']['steps_per_s']:.2f}x",
        f"{results['sampler']['steps_per_s'] / results['trl']['steps_per_s']:.2f}x",
    ]


def shared_prefix_speed(data):
    results = data["results"]

    def passes(engine):  # the training and reference passes, the ones sharing shortens
        phases = results[engine]["phases_median_s"]
        return phases["training"] + phases["reference"]

    return [
        f"{results['sampler']['steps_per_s'] / results['sampler_whole']['steps_per_s']:.2f}x",
        f"{passes('sampler_whole') / passes('sampler'):.2f}x",
    ]


def grpo_vs_ppo(data):
    return [f"{data['grpo_fused_linear']['peak_bytes'] / data['ppo']['peak_bytes']:.3f}x"]


def async_speed(data):
    results = data["results"]
    return [f"{results['async_k1']['steps_per_s'] / results['sync_1thread']['steps_per_s']:.2f}x"]


def real_model_vs_trl(data):
    runs = {run["trainer"]: run for run in data["runs"]}
    ours, trl = runs["grpo_fast"], runs["trl"]

    def step_s(run):
        return statistics.median(step["step_time_s"] for step in run["steps"])

    return [f"{trl['curve'][-1]['seconds'] / ours['curve'][-1]['seconds']:.2f}x", f"{step_s(trl) / step_s(ours):.2f}x"]


def long_context(data):
    # ours with checkpointing on, or one layer input in K (everyK), against TRL's checkpointing on
    (row,) = (r for r in data["comparisons"] if r["model"] == "smollm2" and r["checkpointing"])
    peaks = dict(zip(row["lengths"], row["peak_ratios"]))

    def slope(trainer):  # bytes a completion token from 1K to 2K
        (curve,) = (c for c in data["curves"] if c["trainer"] == trainer and c["checkpointing"])
        points = {p["length"]: p for p in curve["points"] if "peak_bytes" in p}
        a, b = points[1024], points[2048]
        return (b["peak_bytes"] - a["peak_bytes"]) / (b["completion_tokens"] - a["completion_tokens"])

    times = dict(zip(row["lengths"], row["time_ratios"]))
    return [f"{peaks[2048]:.2f}x", f"{slope('grpo_fast') / slope('trl'):.2f}x", f"{times[2048]:.2f}x"]


HEADLINES = {
    "ops_cpu_2threads.json": ops_loss_bf16,
    "fused_linear_cpu.json": fused_linear,
    "trl_cpu.json": trl_update,
    "trainer_cpu_engines_realistic.json": trainer_speed,
    "trainer_cpu_engines_long_prompt_cost_model.json": shared_prefix_speed,
    "memory_cpu_qwen2.5-0.5b.json": grpo_vs_ppo,
    "async_cpu_realistic.json": async_speed,
    "real_model_vs_trl_cpu.json": real_model_vs_trl,
    "long_context_cpu_smollm2_tiles_vs_trl.json": long_context,
}


def headline_rows(text):
    section = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and rule
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_site_home_is_the_readme():
    """docs/index.md is README.md (docs/hooks.py renders it): one front page, kept once; its
    links are the site's (into docs/, or a repository file's path in code)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(DOCS, "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert read("docs/index.md").strip() == hooks.README_MARKER
    home = hooks.front_page(read("README.md"))
    assert headline_rows(home) == headline_rows(read("README.md"))
    assert "](docs/" not in home and "# run the tests" in home
    for target in re.findall(r"\]\(([^)#]+)", home):
        assert target.startswith(("http://", "https://")) or os.path.isfile(os.path.join(DOCS, target)), target
    sample = "see [docs/ops.md](docs/ops.md), [the policy](SECURITY.md), [x](https://a.b/c) and [y](#z)"
    assert (
        hooks.front_page(sample)
        == "see [docs/ops.md](ops.md), the policy (`SECURITY.md`), [x](https://a.b/c) and [y](#z)"
    )


def test_headline_numbers_match_their_json():
    page = "README.md"
    rows = headline_rows(read(page))
    cited = []
    for result, number, command, source in rows:
        name = source.strip("`")
        cited.append(name)
        assert name in HEADLINES, f"{page}: no check for the row citing {name!r} ({result})"
        with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
            expected = HEADLINES[name](json.load(f))
        printed = re.findall(r"\d+(?:\.\d+)?x", number)
        assert printed == expected, f"{page}: {result}: prints {printed}, {name} gives {expected}"
        script = re.match(r"`python ([^\s`]+)", command)
        assert script is None or os.path.isfile(os.path.join(ROOT, script.group(1))), command
        assert command.startswith(("`python benchmarks/", "`grpo-fast ")), command
    assert sorted(cited) == sorted(HEADLINES), f"{page}: the headline table cites {cited}"


def test_the_tool_task_numbers_match_their_json():
    """docs/tools.md's table and the README's sentence print the runs of tools_cpu.json: per seed
    pass@1 with the calculator after the warm start and after RL, without it, the gap."""
    with open(os.path.join(RESULTS, "tools_cpu.json"), encoding="utf-8") as f:
        data = json.load(f)
    runs = {(r["seed"], r["tools"]): r for r in data["runs"]}

    def final(run):
        return run["pass_at_1"][max(run["pass_at_1"], key=int)]

    page = read("docs", "tools.md")
    for seed in sorted({seed for seed, _ in runs}):
        tools, plain = runs[seed, True], runs[seed, False]
        seconds = f"{tools['wall_s']:.0f} s / {plain['wall_s']:.0f} s"
        row = (
            f"| {seed} | {tools['pass_at_1']['0']:.3f} -> {final(tools):.3f} | {plain['pass_at_1']['0']:.3f} -> "
            f"{final(plain):.3f} | {final(tools) - final(plain):+.3f} | {seconds} |"
        )
        assert row in page, row
    readme = " ".join(read("README.md").split())
    finals = ", ".join(f"{final(runs[seed, True]):.2f}" for seed in (0, 1))
    assert f"{finals} and {final(runs[2, True]):.2f} with the calculator" in readme


def test_the_guess_task_numbers_match_their_json():
    """docs/environments.md's table and the README's sentence print the runs of
    guess_number_cpu.json: per seed held-out pass@1 after the warm start and after RL reading
    the answers, with one guess, and in the blind control."""
    with open(os.path.join(RESULTS, "guess_number_cpu.json"), encoding="utf-8") as f:
        runs = {(r["seed"], r["arm"]): r["pass_at_1"] for r in json.load(f)["runs"]}
    seeds = sorted({seed for seed, _ in runs})

    def row(label, arm, at=None):
        values = [runs[seed, arm][at or max(runs[seed, arm], key=int)] for seed in seeds]
        return f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |"

    page = read("docs", "environments.md")
    for line in (
        row("after the warm start (3 turns)", "feedback", "0"),
        row("trained, higher/lower", "feedback"),
        row("trained, `--max-turns 1`", "one_guess"),
        row("trained, blind control", "blind"),
    ):
        assert line in page, line
    readme = " ".join(read("README.md").split())

    def finals(arm):
        return listed(runs[seed, arm][max(runs[seed, arm], key=int)] for seed in seeds)

    assert f"{finals('feedback')} reading the answers against {finals('one_guess')} with one guess" in readme


def listed(values) -> str:
    """Numbers as the README's sentences print them: "0.73, 0.86 and 0.54"."""
    values = [f"{v:.2f}" for v in values]
    return f"{', '.join(values[:-1])} and {values[-1]}"


def test_the_real_model_numbers_match_their_json():
    """docs/models.md's table and the README's sentence print the runs of real_model_cpu.json:
    per seed held-out pass@1 of SmolLM2-135M-Instruct as shipped and after the laptop recipe."""
    with open(os.path.join(RESULTS, "real_model_cpu.json"), encoding="utf-8") as f:
        runs = sorted(json.load(f)["runs"], key=lambda r: r["seed"])
    page = read("docs", "models.md")
    for run in runs:
        row = (
            f"| {run['seed']} | {run['before']:.3f} | {run['after']:.3f} | {run['after'] - run['before']:+.3f} | "
            f"{run['curve'][-1]['step']} | {run['wall_s'] / 60:.1f} |"
        )
        assert row in page, row
    readme = " ".join(read("README.md").split())
    before, after = (listed(run[key] for run in runs) for key in ("before", "after"))
    assert f"held-out pass@1 goes from {before} to {after}" in readme
