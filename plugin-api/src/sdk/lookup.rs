//! Looking a row's own text up, for drafters without weights: the tokens that followed the
//! text's longest trailing n-gram where it occurred before (prompt lookup).

/// The longest trailing n-gram of `text` (n in `min..=max`) at its first earlier occurrence:
/// n, and up to `depth` tokens that followed it there (none, and n = 0, where no n-gram
/// occurred before).
pub fn trailing_ngram(text: &[u32], min: usize, max: usize, depth: usize) -> (usize, &[u32]) {
    for n in (min..=max).rev() {
        if text.len() <= n {
            continue;
        }
        let tail = &text[text.len() - n..];
        // Occurrences that end before the tail starts, so at least one token follows them.
        if let Some(start) = text[..text.len() - 1].windows(n).position(|w| w == tail) {
            let from = start + n;
            return (n, &text[from..(from + depth).min(text.len())]);
        }
    }
    (0, &[])
}

#[cfg(test)]
mod tests {
    use super::trailing_ngram;

    #[test]
    fn prefers_the_longest_trailing_ngram() {
        // "1 2 3" occurs at 0; "3" alone first occurs at 2 too, but the 3-gram wins.
        let text = [1, 2, 3, 9, 1, 2, 3];
        assert_eq!(trailing_ngram(&text, 1, 3, 2), (3, &[9, 1][..]));
    }

    #[test]
    fn uses_the_first_earlier_occurrence() {
        let text = [5, 1, 5, 2, 5];
        assert_eq!(trailing_ngram(&text, 1, 1, 1), (1, &[1][..]));
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_stops_at_the_text_end() {
        let text = [7, 8, 4, 8];
        assert_eq!(trailing_ngram(&text, 1, 3, 5), (1, &[4, 8][..]));
        assert_eq!(trailing_ngram(&[1, 2, 3], 1, 3, 4), (0, &[][..]));
    }
}
