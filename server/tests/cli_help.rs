//! `--help` never prints a secret taken from the environment.

use std::process::Command;

#[test]
fn serve_help_does_not_print_the_admin_token_from_the_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_fairplace-server"))
        .args(["serve", "--help"])
        .env("FAIRPLACE_ADMIN_TOKEN", "sekrit")
        .output()
        .expect("run serve --help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap() + &String::from_utf8(out.stderr).unwrap();
    // The variable is still named, so operators know where the token comes
    // from; its value is not.
    assert!(help.contains("FAIRPLACE_ADMIN_TOKEN"), "{help}");
    assert!(!help.contains("sekrit"), "{help}");
}
