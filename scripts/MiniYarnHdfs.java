// Hadoop's mini-cluster on loopback for scripts/yarn_proof.py: one NameNode and DataNode (MiniDFSCluster), one
// ResourceManager and NodeManager (MiniYARNCluster), in this JVM. Run as a single-file source program (Java 11+
// compiles it in memory; nothing is built or committed) on the `minicluster` artifact set:
//
//   java -cp '.cache/jvm/minicluster/*' scripts/MiniYarnHdfs.java BASE_DIR CONF_DIR [NM_MEMORY_MB]
//
// Writes CONF_DIR/core-site.xml (fs.defaultFS) and CONF_DIR/yarn-site.xml (the ResourceManager's bound addresses
// only) for HADOOP_CONF_DIR / YARN_CONF_DIR, then CONF_DIR/ready, and runs until it
// is killed (a shutdown hook stops both clusters on SIGTERM/SIGINT). Hadoop's own CLI for this,
// org.apache.hadoop.mapreduce.MiniHadoopClusterManager, is in hadoop-client-minicluster but cannot start YARN
// from it: its MapReduce cluster needs org.apache.hadoop.mapred.LocalContainerLauncher (hadoop-mapreduce-client-app),
// which the shaded artifact leaves out (NoClassDefFoundError), and with -nomr it starts no YARN at all.
import java.io.File;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.nio.file.Files;
import java.util.Map;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;

public class MiniYarnHdfs {
    public static void main(String[] args) {
        try {
            run(args);
        } catch (Throwable e) {  // the clusters' own threads would keep a failed JVM alive
            e.printStackTrace();
            System.exit(1);
        }
    }

    static void run(String[] args) throws Exception {
        File base = new File(args[0]).getAbsoluteFile();
        File confDir = new File(args[1]).getAbsoluteFile();
        int nmMemory = args.length > 2 ? Integer.parseInt(args[2]) : 4096;
        Files.createDirectories(confDir.toPath());
        long t0 = System.nanoTime();

        Configuration conf = new YarnConfiguration();
        conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, new File(base, "dfs").getPath());
        conf.set("hadoop.tmp.dir", new File(base, "tmp").getPath());
        // loopback only: every server binds and advertises 127.0.0.1
        conf.set("dfs.namenode.rpc-address", "127.0.0.1:0");
        conf.set("dfs.datanode.address", "127.0.0.1:0");
        conf.set("dfs.datanode.http.address", "127.0.0.1:0");
        conf.set("dfs.datanode.ipc.address", "127.0.0.1:0");
        conf.setBoolean("dfs.permissions.enabled", false);
        MiniDFSCluster dfs = new MiniDFSCluster.Builder(conf).numDataNodes(1).format(true)
                .nameNodePort(0).nameNodeHttpPort(0).build();
        dfs.waitActive();
        String defaultFs = dfs.getFileSystem().getUri().toString();
        conf.set("fs.defaultFS", defaultFs);
        System.err.printf("[MiniYarnHdfs] HDFS up at %s in %.1f s%n", defaultFs, (System.nanoTime() - t0) / 1e9);

        conf.set(YarnConfiguration.RM_HOSTNAME, "127.0.0.1");
        conf.set(YarnConfiguration.NM_ADDRESS, "127.0.0.1:0");
        conf.set(YarnConfiguration.NM_WEBAPP_ADDRESS, "127.0.0.1:0");
        conf.set(YarnConfiguration.NM_LOCALIZER_ADDRESS, "127.0.0.1:0");
        conf.setInt(YarnConfiguration.NM_PMEM_MB, nmMemory);
        conf.setInt(YarnConfiguration.NM_VCORES, 4);
        conf.setInt(YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB, 128);
        // the capacity scheduler (the default) finds no capacity-scheduler.xml on this class path ("Queue
        // configuration missing child queue names for root"): one FIFO queue is all a proof needs
        conf.set(YarnConfiguration.RM_SCHEDULER,
                "org.apache.hadoop.yarn.server.resourcemanager.scheduler.fifo.FifoScheduler");
        conf.setBoolean(YarnConfiguration.NM_VMEM_CHECK_ENABLED, false);
        conf.setBoolean(YarnConfiguration.NM_PMEM_CHECK_ENABLED, false);
        // an application killed is not retried by YARN: the supervisor's restart strategy is what comes back
        conf.setInt(YarnConfiguration.RM_AM_MAX_ATTEMPTS, 1);
        conf.setBoolean(YarnConfiguration.YARN_MINICLUSTER_FIXED_PORTS, false);
        MiniYARNCluster yarn = new MiniYARNCluster("arroyo", 1, 1, 1);
        yarn.init(conf);
        yarn.start();
        if (!yarn.waitForNodeManagersToConnect(60_000)) {
            throw new IllegalStateException("the NodeManager did not register with the ResourceManager in 60 s");
        }
        Configuration out = yarn.getConfig();
        System.err.printf("[MiniYarnHdfs] YARN up: RM %s, web %s, in %.1f s%n", out.get(YarnConfiguration.RM_ADDRESS),
                out.get(YarnConfiguration.RM_WEBAPP_ADDRESS), (System.nanoTime() - t0) / 1e9);

        Configuration core = new Configuration(false);
        core.set("fs.defaultFS", defaultFs);
        try (OutputStream os = new FileOutputStream(new File(confDir, "core-site.xml"))) {
            core.writeXml(os);
        }
        // only the ResourceManager's addresses: the whole configuration carries the mini-cluster's test settings
        // (net.topology.node.switch.mapping.impl=org.apache.hadoop.net.StaticMapping, a class Spark's YARN
        // scheduler then fails to load: ClassNotFoundException in the application master)
        Configuration site = new Configuration(false);
        for (Map.Entry<String, String> entry : out) {
            String key = entry.getKey();
            if (key.startsWith("yarn.resourcemanager.") && (key.endsWith(".address") || key.endsWith(".hostname"))) {
                site.set(key, out.get(key));
            }
        }
        try (OutputStream os = new FileOutputStream(new File(confDir, "yarn-site.xml"))) {
            site.writeXml(os);
        }
        Files.writeString(new File(confDir, "ready").toPath(),
                out.get(YarnConfiguration.RM_WEBAPP_ADDRESS) + "\n" + defaultFs + "\n");

        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            yarn.stop();
            dfs.shutdown();
        }));
        Thread.currentThread().join();
    }
}
