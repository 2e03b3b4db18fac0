//! The fairplace server binary.

use std::io::Read;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "fairplace-server",
    version,
    about = "fairplace placement-decision server"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Decide scenarios (one JSON object, a JSON array, or JSON Lines) and
    /// print one decision per scenario as JSON Lines.
    Decide {
        /// Scenario file, or - for standard input.
        file: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Decide { file } => {
            let mut input = String::new();
            let read = if file == "-" {
                std::io::stdin().read_to_string(&mut input).map(|_| ())
            } else {
                std::fs::read_to_string(&file).map(|s| input = s)
            };
            if let Err(e) = read {
                eprintln!("fairplace-server decide: cannot read {file}: {e}");
                return ExitCode::from(2);
            }
            let stdout = std::io::stdout();
            let stderr = std::io::stderr();
            match fairplace::decide::run(&input, &mut stdout.lock(), &mut stderr.lock()) {
                Ok(0) => ExitCode::SUCCESS,
                Ok(_) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("fairplace-server decide: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
