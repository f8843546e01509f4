"""Dashboards and alert rules as code: `python dashboards/build.py` writes the Grafana dashboards
(`grafana/*.json`, with grafana-foundation-sdk, Grafana's maintained dashboards-as-code SDK) and the
Prometheus alert rules (`prometheus/goodput-alerts.yaml`), and their copies for Kubernetes
(`deploy/base/prometheusrule.yaml`, `deploy/base/dashboards/`); `--check` says whether the
checked-in files are what this code generates (the test suite runs it).

Queries name only metrics of controller/service/metrics.py; tests/cluster/test_observability.py runs
each against a real Prometheus scraping a live run. Panels filter by the `run` variable; every
dashboard also has a `datasource` variable, so it works with whatever the Prometheus data source is
called.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.models.common import BigValueGraphMode
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent / "deploy" / "base"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run"'


# -- alert rules ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alert:
    name: str
    signal: str
    """The PromQL whose value is judged (the live test proves it returns data)."""
    op: str
    threshold: float
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def expr(self) -> str:
        return f"({self.signal}) {self.op} {self.threshold:g}"


ALERTS = (
    Alert("GoodputRunStalled",
          'time() - goodput_run_last_progress_timestamp_seconds and on(run) (goodput_run_state{state="running"} == 1)',
          ">", 600, "1m", "critical", "Run {{ $labels.run }} has made no progress for {{ $value | humanizeDuration }}",
          "The run is running but no step has finished for over 10 minutes, and goodput's own hang detection has "
          "not acted. Look at `goodput events {{ $labels.run }}` and the workers' logs."),
    Alert("GoodputEttrLow",
          'goodput_run_ettr and on(run) (goodput_run_state{state="running"} == 1)',
          "<", 0.9, "30m", "warning", "Run {{ $labels.run }} keeps only {{ $value | humanizePercentage }} of its wall time",
          "Effective training time ratio below 90 % for 30 minutes. goodput_run_badput_seconds says where the time "
          "goes (`goodput report {{ $labels.run }}`)."),
    Alert("GoodputCheckpointStale",
          "goodput_checkpoint_age_seconds / goodput_checkpoint_interval_seconds",
          ">", 2, "1m", "warning", "Run {{ $labels.run }}: latest checkpoint is {{ $value | printf \"%.1f\" }}x its "
                                   "interval old",
          "No checkpoint committed for over twice the expected interval: a failure now loses more work than planned. "
          "Check goodput_checkpoint_failures_total and the object store."),
    Alert("GoodputPersistentStraggler",
          "goodput_rank_straggler_score / on(run) group_left goodput_straggler_ratio",
          ">", 1, "10m", "warning", "Rank {{ $labels.rank }} of run {{ $labels.run }} on {{ $labels.node }} is a "
                                    "straggler",
          "The rank's compute time has been above straggler_ratio x its stage peers' median for 10 minutes. Replace "
          "its node (health.straggler_action: replace) or drain it."),
    Alert("GoodputSdcSuspect",
          'increase(goodput_sdc_events_total{kind="sdc_suspect"}[15m])',
          ">", 0, "0m", "critical", "Silent data corruption suspected in run {{ $labels.run }}",
          "The SDC probes found corrupted state; goodput rolled back to the last clean checkpoint and quarantined the "
          "node. Have the hardware checked before releasing it."),
    Alert("GoodputNodeQuarantined",
          'goodput_node_state{state="quarantined"}',
          "==", 1, "0m", "warning", "Node {{ $labels.node }} is quarantined",
          "goodput took the node out of use (SDC or a repeated failure). It stays out until an operator releases it."),
    Alert("GoodputRunPendingTooLong",
          "goodput_run_pending_seconds",
          ">", 1800, "0m", "warning", "Run {{ $labels.run }} has waited {{ $value | humanizeDuration }} for capacity",
          "The run's plan does not fit the free nodes; `goodput status {{ $labels.run }}` says what it waits for."),
)


def alert_rules() -> dict[str, Any]:
    return {"groups": [{"name": "goodput", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary, "description": a.description}} for a in ALERTS]}]}


# -- dashboards -------------------------------------------------------------------------------------
def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    return query.instant() if instant else query


def ts(title: str, unit: str, *queries: prometheus.Dataquery, w: int = 12, h: int = 8,
       description: str = "") -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DS).span(w).height(h).description(description)
    for query in queries:
        panel = panel.with_target(query)
    return panel


def st(title: str, unit: str, query: prometheus.Dataquery, w: int = 6, h: int = 4,
       description: str = "") -> stat.Panel:
    return (stat.Panel().title(title).unit(unit).datasource(DS).span(w).height(h).description(description)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .graph_mode(BigValueGraphMode.NONE).with_target(query))


def base(title: str, uid: str, description: str) -> dashboard.Dashboard:
    return (dashboard.Dashboard(title).uid(uid).description(description).tags(["goodput"]).refresh("10s")
            .time("now-1h", "now").editable()
            .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(dashboard.QueryVariable("run").label("Run").datasource(DS)
                           .query("label_values(goodput_run_state, run)").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                           .multi(True).include_all(True).all_value(".*")))


def run_overview() -> dashboard.Dashboard:
    return (base("goodput / Run overview", "goodput-run", "A run's progress, goodput and failures")
            .with_row(dashboard.Row("Now"))
            .with_panel(st("State", "none", q(f"goodput_run_state{{{RUN}}} == 1", "{{run}}: {{state}}", instant=True),
                           description="The run's state").text_mode("name"))
            .with_panel(st("ETTR", "percentunit", q(f"goodput_run_ettr{{{RUN}}}", "{{run}}"),
                           description="Time of kept steps / wall time since submission"))
            .with_panel(st("Step", "none", q(f"goodput_run_step{{{RUN}}}", "{{run}}"),
                           description="Last step whose progress the run holds"))
            .with_panel(st("Attempt", "none", q(f"goodput_run_attempt{{{RUN}}}", "{{run}}")))
            .with_panel(ts("Live data-parallel replicas", "none", q(f"goodput_run_live_replicas{{{RUN}}}", "live {{run}}"),
                           q(f"goodput_run_replicas{{{RUN}}}", "of {{run}}", ref="B"), w=24, h=6,
                           description="Under failure_domain replica a lost replica stops alone and the others train "
                                       "on until it rejoins: the dip is the degraded span"))
            .with_panel(ts("Replica protocol", "none",
                           q(f"increase(goodput_replica_steps_discarded_total{{{RUN}}}[$__rate_interval])",
                             "steps discarded {{run}}"),
                           q(f"increase(goodput_replica_resyncs_total{{{RUN}}}[$__rate_interval])",
                             "resync epochs {{run}}", ref="B"),
                           description="Steps the live replicas discarded (a cross-replica collective failed: nothing "
                                       "applied), and the epochs that resolved one with no replica lost"))
            .with_panel(ts("Replica heals", "s",
                           q(f"goodput_replica_heal_seconds_sum{{{RUN}}} / clamp_min(goodput_replica_heal_seconds_count"
                             f"{{{RUN}}}, 1)", "mean heal {{run}}"),
                           q(f"goodput_replica_heal_seconds_count{{{RUN}}}", "heals {{run}}", ref="B"),
                           description="A lost replica's decision to its rejoin with the others' state: the mean so "
                                       "far (0 before the first), and how many (a run of one failure domain has none)"))
            .with_row(dashboard.Row("Training"))
            .with_panel(ts("Loss", "none", q(f"goodput_run_loss{{{RUN}}}", "{{run}}")))
            .with_panel(ts("Tokens per second", "short", q(f"goodput_run_tokens_per_second{{{RUN}}}", "{{run}}")))
            .with_panel(ts("Step time", "s",
                           q(f"histogram_quantile(0.5, sum by (run, le) (rate(goodput_step_seconds_bucket{{{RUN}}}"
                             "[$__rate_interval])))", "p50 {{run}}"),
                           q(f"histogram_quantile(0.95, sum by (run, le) (rate(goodput_step_seconds_bucket{{{RUN}}}"
                             "[$__rate_interval])))", "p95 {{run}}", ref="B")))
            .with_panel(ts("ETTR", "percentunit", q(f"goodput_run_ettr{{{RUN}}}", "run {{run}}"),
                           q(f"goodput_attempt_ettr{{{RUN}}}", "current attempt {{run}}", ref="B"),
                           description="Whole run, and the current attempt over its share of wall time"))
            .with_row(dashboard.Row("Where the time went"))
            .with_panel(ts("Productive and badput seconds", "s",
                           q(f"goodput_run_productive_seconds{{{RUN}}}", "productive {{run}}"),
                           q(f"goodput_run_badput_seconds{{{RUN}}}", "{{category}} {{run}}", ref="B"), w=24,
                           description="They add up to the wall time since submission").stacking(
                               _stacking()))
            .with_row(dashboard.Row("Failures"))
            .with_panel(ts("Failures by cause", "none",
                           q(f"sum by (cause) (goodput_failures_total{{{RUN}}})", "{{cause}}"), w=8))
            .with_panel(ts("Detection and recovery latency (p90 of all failures so far)", "s",
                           q(f"histogram_quantile(0.9, sum by (le) (goodput_failure_detection_seconds_bucket{{{RUN}}}))",
                             "detection"),
                           q(f"histogram_quantile(0.9, sum by (le) (goodput_recovery_seconds_bucket{{{RUN}}}))",
                             "recovery", ref="B"), w=8))
            .with_panel(table.Panel().title("Drills").datasource(DS).span(8).height(8)
                        .with_target(q(f"sum by (run, kind, outcome) (goodput_drills_total{{{RUN}}})", instant=True)
                                     .format(_table_format()))))


def health() -> dashboard.Dashboard:
    return (base("goodput / Health", "goodput-health", "Stragglers, silent data corruption and quarantined nodes")
            .with_panel(ts("Straggler score per rank", "none",
                           q(f"goodput_rank_straggler_score{{{RUN}}}", "rank {{rank}} ({{node}})"),
                           q(f"goodput_straggler_ratio{{{RUN}}}", "straggler_ratio", ref="B"), w=24,
                           description="A rank's compute time / its stage peers' median; above straggler_ratio it "
                                       "is a straggler"))
            .with_panel(ts("Straggler verdicts", "none",
                           q(f"sum by (rank, node) (goodput_straggler_events_total{{{RUN}}})", "rank {{rank}} ({{node}})"),
                           w=8))
            .with_panel(ts("SDC probe events", "none",
                           q(f"sum by (kind) (goodput_sdc_events_total{{{RUN}}})", "{{kind}}"), w=8))
            .with_panel(st("Quarantined nodes (by the run)", "none", q(f"goodput_quarantined_nodes{{{RUN}}}", "{{run}}"),
                           w=8, h=8)))


def checkpoints() -> dashboard.Dashboard:
    return (base("goodput / Checkpoints", "goodput-checkpoints", "Save cost, stalls and the age of the latest commit")
            .with_panel(ts("Age of the latest commit vs 2x the interval", "s",
                           q(f"goodput_checkpoint_age_seconds{{{RUN}}}", "age {{run}}"),
                           q(f"2 * goodput_checkpoint_interval_seconds{{{RUN}}}", "2x interval {{run}}", ref="B"), w=12))
            .with_panel(st("Latest commit: step", "none", q(f"goodput_checkpoint_last_step{{{RUN}}}", "{{run}}"), h=8))
            .with_panel(st("Latest commit: size", "bytes", q(f"goodput_checkpoint_last_bytes{{{RUN}}}", "{{run}}"), h=8))
            .with_panel(ts("Save duration (p50, p90 of all saves)", "s",
                           q(f"histogram_quantile(0.5, sum by (run, le) (goodput_checkpoint_save_seconds_bucket{{{RUN}}}))",
                             "p50 {{run}}"),
                           q(f"histogram_quantile(0.9, sum by (run, le) (goodput_checkpoint_save_seconds_bucket{{{RUN}}}))",
                             "p90 {{run}}", ref="B"), w=8))
            .with_panel(ts("Training blocked per save (mean)", "s",
                           q(f"goodput_checkpoint_stall_seconds_sum{{{RUN}}} / goodput_checkpoint_stall_seconds_count"
                             f"{{{RUN}}}", "{{run}}"), w=8))
            .with_panel(ts("Failed saves and checkpoint stall badput", "none",
                           q(f"goodput_checkpoint_failures_total{{{RUN}}}", "failed saves {{run}}"),
                           q(f'goodput_run_badput_seconds{{{RUN}, category="checkpoint_stall"}}', "stall s {{run}}",
                             ref="B"), w=8)))


def cluster() -> dashboard.Dashboard:
    return (base("goodput / Cluster", "goodput-cluster", "Nodes by state and the runs on the service")
            .with_panel(bargauge.Panel().title("Nodes by state").datasource(DS).span(8).height(8)
                        .with_target(q("goodput_nodes", "{{state}}", instant=True)))
            .with_panel(table.Panel().title("Nodes").datasource(DS).span(16).height(8)
                        .with_target(q("goodput_node_state == 1", instant=True).format(_table_format())))
            .with_panel(ts("Runs by state", "none", q("sum by (state) (goodput_run_state)", "{{state}}"), w=12))
            .with_panel(ts("Time waiting for capacity", "s", q(f"goodput_run_pending_seconds{{{RUN}}}", "{{run}}"),
                           w=12))
            .with_panel(ts("GPUs each team holds (goodput teams: against its quota)", "none",
                           q("goodput_team_gpus", "{{team}}"), w=12))
            .with_panel(ts("Each team's queue: runs waiting and the longest wait", "none",
                           q("goodput_team_queued_runs", "queued {{team}}"),
                           q("goodput_team_queue_wait_seconds", "longest wait s {{team}}", ref="B"), w=12)))


DASHBOARDS = {"goodput-run": run_overview, "goodput-health": health, "goodput-checkpoints": checkpoints,
              "goodput-cluster": cluster}


def _stacking() -> Any:
    from grafana_foundation_sdk.builders.common import StackingConfig
    from grafana_foundation_sdk.models.common import StackingMode

    return StackingConfig().mode(StackingMode.NORMAL)


def _table_format() -> Any:
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    return PromQueryFormat.TABLE


# -- files ------------------------------------------------------------------------------------------
def render() -> dict[Path, str]:
    """Every generated file, path -> content."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    files = {}
    for uid, build in DASHBOARDS.items():
        model = build().build()
        for i, panel in enumerate(model.panels or []):
            panel.id_val = i + 1  # Grafana keys panel links and edits by id
        files[HERE / "grafana" / f"{uid}.json"] = encoder.encode(model) + "\n"
    header = "# Generated by dashboards/build.py from its ALERTS; edit there and run it again.\n"
    files[HERE / "prometheus" / "goodput-alerts.yaml"] = header + yaml.safe_dump(alert_rules(), sort_keys=False,
                                                                                  width=120)
    # The same for Kubernetes (deploy/): a PrometheusRule, and the dashboards for Grafana's sidecar
    # (kustomize reads files only from inside its own folder).
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "goodput", "labels": {"app.kubernetes.io/name": "goodput-controller"}},
            "spec": alert_rules()}
    files[DEPLOY / "prometheusrule.yaml"] = header + yaml.safe_dump(rule, sort_keys=False, width=120)
    for uid in DASHBOARDS:
        files[DEPLOY / "dashboards" / f"{uid}.json"] = files[HERE / "grafana" / f"{uid}.json"]
    return files


def dashboard_json(uid: str) -> dict[str, Any]:
    return json.loads((HERE / "grafana" / f"{uid}.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a checked-in file differs")
    opts = parser.parse_args()
    stale = []
    for path, text in render().items():
        if opts.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(HERE.parent)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print("out of date (run `python dashboards/build.py`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
