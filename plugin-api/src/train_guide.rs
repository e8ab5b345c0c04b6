//! # Training a drafter for your target
//!
//! The [`guide`](crate::guide) shows how to write a drafter; this one shows how to train one of
//! the shipped kinds for your own Gemma 4 checkpoint and measure what it buys. Everything runs on
//! a CPU; the commands are the ones that made the demo drafters in `models/`.
//!
//! 1. **Your target.** A Gemma 4 checkpoint directory as Hugging Face lays it out
//!    (`config.json`, `model.safetensors`, `tokenizer.json`) that mlx-lm loads. Check that the
//!    host serves it: `host check-model DIR`.
//! 2. **Train.** `make train-drafter KIND=dflash TARGET=DIR` (or `dspark`, `deepspec`,
//!    `assistant`) writes `DIR-dflash` beside it, in the kind's own format, with a model card.
//!    The first run of any kind makes the training data once (`training/drafter_data.py`): the
//!    target's own greedy continuations of training text, with its hidden states at the tapped
//!    layers. The labels are what *your* target would say, so the drafter learns to agree with
//!    it. Bring your own text by pointing `training/corpus.py` at it. A run is seeded, shows a
//!    progress bar and resumes from its last saved step when started again; the demo drafters
//!    took 7 to 17 minutes each on two cores, after the shared data (about 5 minutes, once).
//!    Scale the preset in `training/train_<kind>.py` (layers, width, steps) to your target: a
//!    drafter is worth it only while it costs a small share of a target step. The assistant also gets a centroid head after training
//!    (`training/fit_centroids.py`, also runnable alone on a trained assistant), so that a
//!    draft step scores a few groups of tokens instead of the whole vocabulary; its card says
//!    how often the draft still lies in the groups kept. `make train-drafter KIND=lookup
//!    TARGET=DIR` trains nothing: it writes a datastore of the target's own greedy
//!    continuations of prompts taken from the text (about 10 minutes for a million tokens on
//!    two cores), in which the `lookup` plugin looks the request's trailing n-gram up beside
//!    the request's own text (prompt lookup), drafting from whichever matched longer. It needs no reference check, and on
//!    a small target, where a learned drafter's pass is large beside a target step, it is the
//!    one to try first.
//! 3. **Check it against its reference.** `tests/oracle/{dflash,deepspec,dspark,assistant}_oracle.py
//!    --trained DIR-<kind>` records what the kind's reference implementation (dflash 0.1.0,
//!    dspark-mlx 0.1.0, the NumPy equations, transformers 5.23.0 in `tests/oracle/.venv-hf`)
//!    drafts on three target states; the host's plugin must draft the same
//!    (`host/tests/trained_drafters.rs` shows the test).
//! 4. **Run it.** A manifest names the target and the drafter:
//!
//!    ```toml
//!    [target]
//!    model = "DIR"
//!
//!    [drafter]
//!    kind = "dflash"
//!    artifact = "DIR-dflash"
//!    draft_tokens = 4
//!    ```
//!
//!    `host run --manifest m.toml --compare-plain` generates, then decodes the same request
//!    plainly and says how much faster the drafter made it and whether the output is identical
//!    (greedy and `match` verification always are).
//! 5. **Measure.** `host bench --sweep m.toml[,other.toml…] --prompts-file prompts.jsonl
//!    --draft-tokens 1,2,3,4,6,8 --max-tokens 256 [--temperature 0.7] --plot speedup.png`
//!    times every drafter at every draft length against plain decoding on each prompt (one
//!    JSON object with a `prompt` per line; take them from text the drafter never saw), and
//!    prints a Markdown table: τ (tokens per target forward), acceptance by draft position,
//!    target forwards, the wall-clock speed-up with its range over the prompts, and a round's
//!    mean time drafting and verifying, in milliseconds and in plain decoding's steps. Pick the
//!    draft length with the best median and put it in the manifest.
//!
//! What decides the speed-up: τ against the cost of a round (the drafter's pass plus a
//! verify window of γ+1 tokens), about τ over that cost in plain steps (the sweep's "a round:
//! draft + verify" column). On the CPU a verify window costs more than a one-token step though
//! far less than a step per token, and the drafter's pass is arithmetic of its own beside it.
//! So the larger the target's step against the drafter's pass, the more τ buys: on a target as
//! small as the demo one, a learned drafter's pass costs a round a good part of a step, and
//! the lookup drafters, which draft for free, do better (docs/performance.md has the figures).
//! `host run --stats` shows τ, acceptance by position and a round's drafting and verifying
//! time for one request.
