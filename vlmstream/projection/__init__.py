"""How long a job takes: live rates while it runs, and the projection of a whole job from a measured sample.

Pure arithmetic on numbers the callers read (offsets, timestamps, per-image stage times): no Kafka, no stage.
Everything counts images, the unit of work: a document of 40 images is 40 times the work of one of one.

    live     while a job runs: each stage's rate, drift and ETA (``StageMeter``), the stage that limits the run
             (``bottleneck``), the progress line
    sample   what a sample run measured: each image's size class and stage times (``SampleImage``), its warm-up and
             steady window (``sample_windows``)
    costs    the cost model fitted on the sample: seconds per image by size class, a batch's fixed part, and the
             scale to wall seconds on this machine (``calibrate``, ``ClassCosts``)
    job      the whole job's wall time and its range from that model (``project``)

live and sample import nothing of the package, costs the sample, job the costs and the sample: no circle.
"""
