/*
 * airflow-arroyo: Hadoop's LocalFileSystem (checksummed, as `file:` is by default) over NioRawLocalFileSystem.
 * Spark uses it for `file:` paths when `spark.hadoop.fs.file.impl` names it (airflow_arroyo.jvm).
 */
package airflow.arroyo.hadoop;

import org.apache.hadoop.fs.LocalFileSystem;

public class NioLocalFileSystem extends LocalFileSystem {
  public NioLocalFileSystem() {
    super(new NioRawLocalFileSystem());
  }
}
