//! Models from the Hugging Face Hub, as llama.cpp takes them: `-hf OWNER/REPO[:QUANT]` picks
//! the repository's GGUF of that quantization (Q4_K_M when none is named; every shard of a split
//! model), `--hf-file` names the file, `--model-url` downloads any URL. Files land in the cache
//! directory (`LLAMA_CACHE`, else `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`) named
//! `OWNER_REPO_FILE`, as llama.cpp names them; a file already there is used as it is.
//!
//! Downloads resume: bytes go to `FILE.part`, and a cut connection (or a new run after one)
//! continues from its length with an HTTP range request. `HF_TOKEN` (or `--hf-token`) is sent as a
//! bearer token, `HF_ENDPOINT` replaces `https://huggingface.co`. A progress bar shows on stderr.

use anyhow::{bail, Context as _};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Attempts per file: a cut connection resumes up to this many times.
const ATTEMPTS: usize = 8;

/// Where a model comes from, besides `-m`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct HubArgs {
    /// A Hugging Face repository and quantization (also -hf): OWNER/REPO[:QUANT] (e.g.
    /// unsloth/Kimi-K2-Instruct-GGUF:Q4_K_M; without QUANT, Q4_K_M if present).
    #[arg(long = "hf-repo", value_name = "OWNER/REPO[:QUANT]")]
    pub hf_repo: Option<String>,
    /// The file of --hf-repo to take (the first shard, for a split model).
    #[arg(long = "hf-file", value_name = "FILE", requires = "hf_repo")]
    pub hf_file: Option<String>,
    /// A GGUF to download from any URL.
    #[arg(long = "model-url", value_name = "URL", conflicts_with = "hf_repo")]
    pub model_url: Option<String>,
    /// Hugging Face access token [default: HF_TOKEN].
    #[arg(long = "hf-token", value_name = "TOKEN")]
    pub hf_token: Option<String>,
}

impl HubArgs {
    pub fn wanted(&self) -> bool {
        self.hf_repo.is_some() || self.model_url.is_some()
    }

    /// Downloads what the flags name (unless cached) and returns the path to load.
    pub fn fetch(&self) -> anyhow::Result<PathBuf> {
        let hub = Hub::from_env(self.hf_token.clone())?;
        if let Some(url) = &self.model_url {
            let name = url.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("model.gguf");
            let name = name.split('?').next().unwrap_or(name);
            let dest = hub.cache.join(sanitize(name));
            hub.download(url, &dest)?;
            return Ok(dest);
        }
        let Some(spec) = &self.hf_repo else { bail!("no model to download") };
        let (repo, quant) = match spec.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (spec.as_str(), None),
        };
        if repo.split('/').count() != 2 || repo.split('/').any(str::is_empty) {
            bail!("-hf {spec:?}: give OWNER/REPO[:QUANT]");
        }
        let files = match &self.hf_file {
            Some(f) => vec![f.clone()],
            None => hub.list(repo)?,
        };
        let chosen = choose(&files, self.hf_file.as_deref(), quant)
            .with_context(|| format!("-hf {spec}: the repository's GGUF files: {}", files.join(", ")))?;
        let mut first = None;
        for f in &chosen {
            let url = format!("{}/{repo}/resolve/main/{f}", hub.endpoint);
            let dest = hub.cache.join(sanitize(&format!("{}_{}", repo.replace('/', "_"), f)));
            hub.download(&url, &dest)?;
            first.get_or_insert(dest);
        }
        first.context("nothing to download")
    }
}

/// The GGUF files to download: `hf_file`, else those of `quant` (Q4_K_M when none is named),
/// every shard of a split model.
fn choose(files: &[String], hf_file: Option<&str>, quant: Option<&str>) -> anyhow::Result<Vec<String>> {
    let ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
    let first = match hf_file {
        Some(f) => f.to_string(),
        None => {
            let want = quant.unwrap_or("Q4_K_M").to_ascii_lowercase();
            let mut matching: Vec<&&String> = ggufs.iter().filter(|f| f.to_ascii_lowercase().contains(&want)).collect();
            matching.sort();
            match (matching.first(), quant, ggufs.first()) {
                (Some(f), _, _) => f.to_string(),
                (None, None, Some(f)) => f.to_string(),
                (None, Some(q), _) => bail!("no GGUF of quantization {q}"),
                (None, None, None) => bail!("no GGUF file"),
            }
        }
    };
    // PREFIX-00001-of-00003.gguf: all of its shards
    if let Some((prefix, _, count)) = tandem_gguf::parse_split_name(Path::new(&first)) {
        let dir = first.rsplit_once('/').map_or("", |(d, _)| d);
        let base = prefix.rsplit('/').next().unwrap_or(&prefix);
        return Ok((1..=count)
            .map(|i| {
                let name = format!("{base}-{i:05}-of-{count:05}.gguf");
                if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                }
            })
            .collect());
    }
    Ok(vec![first])
}

/// A file name without path separators or control characters.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c == '/' || c == '\\' || c.is_control() { '_' } else { c }).collect()
}

struct Hub {
    client: reqwest::blocking::Client,
    endpoint: String,
    token: Option<String>,
    cache: PathBuf,
}

impl Hub {
    fn from_env(token: Option<String>) -> anyhow::Result<Hub> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .unwrap_or_else(|_| "https://huggingface.co".into())
            .trim_end_matches('/')
            .to_string();
        let token = token.or_else(|| std::env::var("HF_TOKEN").ok()).filter(|t| !t.is_empty());
        let cache = match std::env::var_os("LLAMA_CACHE") {
            Some(d) => PathBuf::from(d),
            None => match std::env::var_os("XDG_CACHE_HOME") {
                Some(d) => PathBuf::from(d).join("tandem"),
                None => {
                    PathBuf::from(std::env::var_os("HOME").context("no HOME for the cache directory; set LLAMA_CACHE")?)
                        .join(".cache/tandem")
                }
            },
        };
        std::fs::create_dir_all(&cache).with_context(|| format!("creating the cache directory {}", cache.display()))?;
        let client = reqwest::blocking::Client::builder()
            .user_agent(concat!("tandem/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(30))
            .timeout(None)
            .build()
            .context("starting the HTTP client")?;
        Ok(Hub { client, endpoint, token, cache })
    }

    fn get(&self, url: &str) -> reqwest::blocking::RequestBuilder {
        let req = self.client.get(url);
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The repository's file names.
    fn list(&self, repo: &str) -> anyhow::Result<Vec<String>> {
        let url = format!("{}/api/models/{repo}", self.endpoint);
        let resp = self.get(&url).send().with_context(|| format!("listing {url}"))?;
        let status = resp.status();
        if !status.is_success() {
            bail!("listing {url}: HTTP {status}{}", if status.as_u16() == 401 { " (set HF_TOKEN?)" } else { "" });
        }
        let v: serde_json::Value = resp.json().with_context(|| format!("listing {url}: not JSON"))?;
        let files = v["siblings"]
            .as_array()
            .map(|s| s.iter().filter_map(|f| f["rfilename"].as_str().map(String::from)).collect::<Vec<_>>())
            .unwrap_or_default();
        if files.is_empty() {
            bail!("{url}: no files listed");
        }
        Ok(files)
    }

    /// Downloads `url` to `dest` (unless it is there), resuming from `dest.part`.
    fn download(&self, url: &str, dest: &Path) -> anyhow::Result<()> {
        if dest.exists() {
            tracing::info!("{} (cached)", dest.display());
            return Ok(());
        }
        let part = PathBuf::from(format!("{}.part", dest.display()));
        let mut last_err = None;
        for attempt in 0..ATTEMPTS {
            match self.try_download(url, &part) {
                Ok(()) => {
                    std::fs::rename(&part, dest).with_context(|| format!("renaming {}", part.display()))?;
                    return Ok(());
                }
                Err(e) if e.downcast_ref::<Fatal>().is_some() => return Err(e),
                Err(e) => {
                    let have = std::fs::metadata(&part).map_or(0, |m| m.len());
                    tracing::warn!("{url}: {e:#}; resuming at byte {have} (attempt {} of {ATTEMPTS})", attempt + 2);
                    last_err = Some(e);
                    std::thread::sleep(Duration::from_millis(200 << attempt.min(5)));
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("download failed")))
            .with_context(|| format!("downloading {url}"))
    }

    fn try_download(&self, url: &str, part: &Path) -> anyhow::Result<()> {
        let have = std::fs::metadata(part).map_or(0, |m| m.len());
        let mut req = self.get(url);
        if have > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
        }
        let mut resp = req.send().with_context(|| format!("GET {url}"))?;
        let status = resp.status();
        let append = match status.as_u16() {
            206 => true,
            200 => false,
            416 if have > 0 => {
                // the part already holds the whole file
                return Ok(());
            }
            401 | 403 => return Err(Fatal(format!("GET {url}: HTTP {status} (set HF_TOKEN?)")).into()),
            404 => return Err(Fatal(format!("GET {url}: HTTP 404, no such file")).into()),
            _ => bail!("GET {url}: HTTP {status}"),
        };
        let total = resp.content_length().map(|n| if append { n + have } else { n });
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(part)
            .with_context(|| format!("writing {}", part.display()))?;
        let start = if append { have } else { 0 };
        let bar = indicatif::ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bytes}/{total_bytes} {bar:30} {bytes_per_sec} {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(url.rsplit('/').next().unwrap_or(url).to_string());
        bar.set_position(start);
        let mut buf = vec![0u8; 1 << 20];
        let mut got = start;
        loop {
            let n = resp.read(&mut buf).context("reading the response")?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n]).with_context(|| format!("writing {}", part.display()))?;
            got += n as u64;
            bar.set_position(got);
        }
        file.flush()?;
        bar.finish_and_clear();
        if let Some(t) = total {
            if got < t {
                bail!("the connection closed after {got} of {t} bytes");
            }
        }
        Ok(())
    }
}

/// An error retrying cannot mend.
#[derive(Debug)]
struct Fatal(String);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Fatal {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_and_shards_are_chosen() {
        let files: Vec<String> = [
            "README.md",
            "Kimi-Q2_K.gguf",
            "Q4_K_M/Kimi-Q4_K_M-00001-of-00003.gguf",
            "Q4_K_M/Kimi-Q4_K_M-00002-of-00003.gguf",
            "Q4_K_M/Kimi-Q4_K_M-00003-of-00003.gguf",
        ]
        .map(String::from)
        .to_vec();
        let shards = choose(&files, None, None).unwrap();
        assert_eq!(shards.len(), 3);
        assert_eq!(shards[1], "Q4_K_M/Kimi-Q4_K_M-00002-of-00003.gguf");
        assert_eq!(choose(&files, None, Some("q2_k")).unwrap(), ["Kimi-Q2_K.gguf"]);
        assert!(choose(&files, None, Some("Q8_0")).unwrap_err().to_string().contains("Q8_0"));
        assert_eq!(sanitize("a/b\nc"), "a_b_c");
    }
}
