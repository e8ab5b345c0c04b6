//! A completion's text as it streams, cut at the first stop string. Text that could be the
//! start of a stop string is held until the next piece decides it, so a stop string split
//! across tokens is still found and never emitted.

pub struct StopText {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> StopText {
        StopText { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), stopped: false }
    }

    /// The text that `piece` makes safe to emit (possibly empty). After a stop string, nothing.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let out = self.held[..at].to_owned();
            self.held.clear();
            return out;
        }
        let keep = self.longest_stop_prefix_suffix();
        let out = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        out
    }

    /// What is still held, once the generation has ended.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Bytes at the end of `held` that begin some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let held = &self.held;
        (1..=held.len())
            .rev()
            .filter(|&n| held.is_char_boundary(held.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&held[held.len() - n..])))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `pieces` and returns (emitted text, stopped).
    fn stream(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut t = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out: String = pieces.iter().map(|p| t.push(p)).collect();
        if !t.stopped() {
            out += &t.finish();
        }
        (out, t.stopped())
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_not_emitted() {
        assert_eq!(stream(&["\n\n"], &["And God", " said\n", "\nLet"]), ("And God said".into(), true));
        assert_eq!(stream(&["LORD"], &["the LO", "RD", " God"]), ("the ".into(), true));
    }

    #[test]
    fn held_text_that_turns_out_not_to_stop_is_emitted_in_order() {
        assert_eq!(stream(&["LORD"], &["the LO", "ng day"]), ("the LOng day".into(), false));
        assert_eq!(stream(&["LORD"], &["the LO"]), ("the LO".into(), false));
        let mut t = StopText::new(vec!["LORD".into()]);
        assert_eq!(t.push("the LO"), "the ");
        assert_eq!(t.push("ng"), "LOng");
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(stream(&["God", "said"], &["And God said"]), ("And ".into(), true));
        assert_eq!(stream(&["said", "God"], &["And God said"]), ("And ".into(), true));
    }

    #[test]
    fn without_stop_strings_everything_passes_at_once() {
        let mut t = StopText::new(vec![String::new()]);
        assert_eq!(t.push("abc"), "abc");
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        assert_eq!(stream(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(stream(&["éx"], &["café", " ok"]), ("café ok".into(), false));
    }
}
