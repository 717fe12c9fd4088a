//! Examples in the Markdown docs that tests run, so a doc cannot drift from the code.

/// The body of the first fenced ` ```json ` block of `doc` (the file `name`, for the
/// panic message).
pub fn first_json_block<'a>(doc: &'a str, name: &str) -> &'a str {
    let fence = "```json\n";
    let start = doc
        .find(fence)
        .unwrap_or_else(|| panic!("{name} has a json block"))
        + fence.len();
    let len = doc[start..]
        .find("```")
        .unwrap_or_else(|| panic!("{name}'s json block ends"));
    &doc[start..start + len]
}
