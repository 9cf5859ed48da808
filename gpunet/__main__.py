from gpunet.cli import main

main()
