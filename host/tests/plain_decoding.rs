//! Plain decoding on MLX's route (the one Metal and CUDA take) is pipelined: a step is built on
//! the previous step's token while that token is still being computed, and the host reads each
//! token back once. On the CPU loops' route tokens are read as they are drawn.

use std::path::Path;

use host::generate::{generate, last_logits, token_ids, Request};
use host::model::load;
use host::sampling::{draw_token, Drawn, SamplingParams};
use mlx_rs::Array;

/// Whether MLX has computed `a`.
fn computed(a: &Array) -> bool {
    let mut available = false;
    // SAFETY: `a` is a valid array; the call writes one bool.
    unsafe { mlx_sys::_mlx_array_is_available(&mut available, a.as_ptr()) };
    available
}

const PROMPT: [u32; 12] = [2, 17, 40, 9, 33, 17, 40, 9, 61, 5, 17, 40];

/// Two steps built one on the other read nothing back: after both are built, the first
/// token is still uncomputed; read, both tokens are plain decoding's.
#[test]
fn a_step_is_built_on_the_last_token_before_it_is_read() {
    host::runtime::init();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/ple-kvshare");
    let model = load(&dir).unwrap();
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.9, seed: 3, ..Default::default() };
    for params in [SamplingParams::default(), sampled] {
        let request = Request { prompt: PROMPT.to_vec(), max_tokens: 2, sampling: params, ..Default::default() };
        let plain = generate(&model, &request, |_| ()).unwrap().tokens;
        let mut caches = model.make_caches(1, 0);
        let prompt_logits =
            last_logits(&model, &model.forward_hidden(&token_ids(&PROMPT), &mut caches, None).unwrap()).unwrap();
        prompt_logits.eval().unwrap();
        let first = draw_token(&prompt_logits, &params, 0).unwrap();
        let Drawn::OnDevice { token, .. } = &first else {
            assert!(kernels::route::on_cpu(), "a token read at once on MLX's route");
            assert_eq!(first.read().unwrap(), plain[0]);
            continue;
        };
        let hidden = model.forward_hidden(&first.ids().unwrap(), &mut caches, None).unwrap();
        let second = draw_token(&last_logits(&model, &hidden).unwrap(), &params, 1).unwrap();
        assert!(!computed(token), "building the next step read the token back ({params:?})");
        assert_eq!([first.read().unwrap(), second.read().unwrap()], plain[..], "{params:?}");
    }
}

/// A step queued past an end of generation is computed and dropped, and not counted among the
/// target's forwards: one for the prompt, one per token after the first.
#[test]
fn a_step_queued_past_the_end_is_not_counted() {
    host::runtime::init();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/ple-kvshare");
    let model = load(&dir).unwrap();
    let request =
        Request { prompt: PROMPT.to_vec(), max_tokens: 16, sampling: SamplingParams::default(), ..Default::default() };
    let plain = generate(&model, &request, |_| ()).unwrap().tokens;
    let at = (1..plain.len()).find(|&i| !plain[..i].contains(&plain[i])).expect("a token not seen before it");
    let ended = generate(&model, &Request { eos: vec![plain[at]], ..request }, |_| ()).unwrap();
    assert_eq!(ended.tokens, plain[..at]);
    assert_eq!(ended.stats.target_forwards, 1 + at, "forwards for {at} tokens and the end");
}
