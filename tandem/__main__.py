from tandem.cli import main
from tandem.core.fastexit import run_and_exit

if __name__ == "__main__":
    run_and_exit(main)
