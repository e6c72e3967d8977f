from echo_cli.app import main

main()
