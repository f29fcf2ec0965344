//! A real Prometheus (Debian's `prometheus` package, installed by `cargo xtask setup`) started in a
//! test's node netns, scraping the agent there, and asked through its HTTP query API as Kiali and
//! Grafana ask it. What it answers is what a cluster's Prometheus would make of the agent's text:
//! its parser is stricter than the suite's, so a malformed family fails the scrape (`up` is 0).
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::exec::Place;
use crate::proc::Proc;

/// Where Debian's package puts the server.
const DEFAULT_BIN: &str = "/usr/bin/prometheus";
/// The job every target is scraped under.
pub const JOB: &str = "redirect";
/// How often it scrapes: short, so a test sees its traffic within a second or two.
const SCRAPE_INTERVAL: &str = "1s";

/// A running Prometheus; killed on drop, its data directory left in the run's scratch space.
pub struct Prometheus {
    place: Place,
    listen: SocketAddr,
    _proc: Proc,
}

/// One series of an instant query's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Prometheus {
    /// Starts Prometheus in `place`, listening on `listen` (an address of that netns), scraping
    /// `metrics_path` of each of `targets` every second; `dir` holds its configuration and data.
    /// Returns once it answers ready.
    pub fn start(
        place: &Place,
        listen: SocketAddr,
        dir: &Path,
        targets: &[SocketAddr],
        metrics_path: &str,
    ) -> Result<Prometheus> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let config = dir.join("prometheus.yml");
        std::fs::write(&config, scrape_config(targets, metrics_path))
            .with_context(|| format!("writing {}", config.display()))?;
        let proc = place
            .cmd(bin()?)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .spawn()?;
        let prometheus = Prometheus {
            place: place.clone(),
            listen,
            _proc: proc,
        };
        prometheus.wait_ready(Duration::from_secs(30))?;
        Ok(prometheus)
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + crate::pace::scaled(timeout);
        loop {
            let out = self
                .place
                .cmd("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "2",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                ])
                .arg(format!("http://{}/-/ready", self.listen))
                .output()?;
            if out.stdout_str() == "200" {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("Prometheus on {} not ready: {out}", self.listen);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// An instant query (`/api/v1/query`): the series of its vector answer.
    pub fn query(&self, promql: &str) -> Result<Vec<Sample>> {
        let out = self
            .place
            .cmd("curl")
            .args(["-sS", "--max-time", "10", "-G", "--data-urlencode"])
            .arg(format!("query={promql}"))
            .arg(format!("http://{}/api/v1/query", self.listen))
            .ok()?;
        parse_answer(&out.stdout_str()).with_context(|| format!("query {promql}"))
    }

    /// Asks `promql` until `done` holds of its answer (a scrape a second; the first after a change
    /// may be up to that late), and returns that answer.
    pub fn query_until(
        &self,
        promql: &str,
        timeout: Duration,
        done: impl Fn(&[Sample]) -> bool,
    ) -> Result<Vec<Sample>> {
        let deadline = Instant::now() + crate::pace::scaled(timeout);
        loop {
            let answer = self.query(promql)?;
            if done(&answer) {
                return Ok(answer);
            }
            if Instant::now() > deadline {
                bail!("Prometheus answered {promql} with {answer:?} until the deadline");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

fn bin() -> Result<PathBuf> {
    let bin = std::env::var_os("PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN));
    if !bin.is_file() {
        bail!(
            "{} not found: install Debian package prometheus (`cargo xtask setup` does)",
            bin.display()
        );
    }
    Ok(bin)
}

fn scrape_config(targets: &[SocketAddr], metrics_path: &str) -> String {
    let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    format!(
        "global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: {SCRAPE_INTERVAL}\nscrape_configs:\n  - job_name: {JOB}\n    metrics_path: '{metrics_path}'\n    static_configs:\n      - targets: [{}]\n",
        targets.join(", ")
    )
}

/// The series of a `vector` answer; an error answer or another type is an error.
fn parse_answer(text: &str) -> Result<Vec<Sample>> {
    let answer: Value = serde_json::from_str(text).with_context(|| format!("not JSON: {text}"))?;
    if answer["status"] != "success" {
        bail!("Prometheus refused the query: {text}");
    }
    if answer["data"]["resultType"] != "vector" {
        bail!("not a vector: {text}");
    }
    let series = answer["data"]["result"]
        .as_array()
        .with_context(|| format!("no result: {text}"))?;
    series
        .iter()
        .map(|s| {
            let labels = s["metric"]
                .as_object()
                .context("a series without labels")?
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect();
            let value = s["value"][1]
                .as_str()
                .context("a series without a value")?
                .parse::<f64>()
                .context("a value that is no number")?;
            Ok(Sample { labels, value })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vector_answer_gives_its_series_and_an_error_is_an_error() -> Result<()> {
        let text = r#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"job":"redirect","outcome":"passthrough"},"value":[1700000000.1,"5"]},
            {"metric":{},"value":[1700000000.1,"0.25"]}]}}"#;
        let samples = parse_answer(text)?;
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].labels["outcome"], "passthrough");
        assert_eq!(samples[0].value, 5.0);
        assert_eq!(samples[1].value, 0.25);
        let refused = r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#;
        assert!(parse_answer(refused).is_err());
        let scalar = r#"{"status":"success","data":{"resultType":"scalar","result":[1,"2"]}}"#;
        assert!(parse_answer(scalar).is_err());
        Ok(())
    }

    #[test]
    fn the_scrape_config_names_every_target_and_the_path() -> Result<()> {
        let targets = ["127.0.0.1:15000".parse()?, "[fd00::1]:15020".parse()?];
        let config = scrape_config(&targets, "/metrics");
        assert!(
            config.contains("targets: ['127.0.0.1:15000', '[fd00::1]:15020']"),
            "{config}"
        );
        assert!(config.contains("metrics_path: '/metrics'"), "{config}");
        assert!(config.contains("job_name: redirect"), "{config}");
        Ok(())
    }
}
