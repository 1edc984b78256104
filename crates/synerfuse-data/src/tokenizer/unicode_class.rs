//! Unicode general categories the GPT-2 pattern uses.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// `\p{L}`: an upper-, lower-, title-case, modifier or other letter.
pub fn is_letter(c: char) -> bool {
    matches!(
        get_general_category(c),
        G::UppercaseLetter
            | G::LowercaseLetter
            | G::TitlecaseLetter
            | G::ModifierLetter
            | G::OtherLetter
    )
}
